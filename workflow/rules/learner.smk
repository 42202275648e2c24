# Learner throughput: bench-learner per arm, or, with `rounds: N` in the bench_learner job, every arm once per
# round for N rounds (minite.report.rounds: ratios paired within a round); rollout throughput: bench-sampler
# per arm (when the profile has a bench_sampler job), in rounds the same way with `rounds: N` there; then the
# table (csv/md/tex, learner and rollout columns) and the bar figure.
LEARNER_ROUNDS = int(job("bench_learner").get("rounds", 1))


def round_plan(arms: list[str], rounds: int) -> list[tuple[str, int]]:
    """(arm, round) in run order: round after round, each over every arm, round k starting at arm k mod n,
    so no arm always runs first (after whatever job ran before) or last."""
    return [(arms[(k + i) % len(arms)], k) for k in range(rounds) for i in range(len(arms))]


def rounds_shell(bench: str, runner: str) -> str:
    """The shell of a rounds job (`bench`: learner or sampler; `runner`: the command that runs minite's CLI):
    run-rounds, then merge-rounds, from the rule's params results, plan, args, arms and rounds."""
    return ("OMP_NUM_THREADS={threads} {PY} -m minite.report run-rounds --bench " + bench + " --results"
            " {params.results} --plan '{params.plan}' --runner '" + runner + "' --args {params.args} > {log} 2>&1"
            " && {PY} -m minite.report merge-rounds --bench " + bench + " --results {params.results}"
            " --arms {params.arms} --rounds {params.rounds} >> {log} 2>&1")


if LEARNER_ROUNDS == 1:

    rule bench_learner:
        input:
            arm=arm_yaml,
            model=model_inputs("bench_learner"),
        output:
            f"{RESULTS}/{{arm}}/learner.json",
        params:
            args=job_args("bench_learner"),
        log:
            f"{LOGS}/bench_learner/{{arm}}.log",
        threads: job_threads("bench_learner")  # a benchmark: by default it has the machine to itself
        resources:
            gpu=job_gpus("bench_learner"),
        shell:
            "OMP_NUM_THREADS={threads} " + minite("bench_learner") + " bench-learner --arm {wildcards.arm}"
            " {params.args} --out {output} > {log} 2>&1"

else:

    # One job for all arms: a round pairs the arms measured in it, so one arm is never re-measured alone.
    # A failed run fails the job (nothing merged); the next attempt keeps the rounds the failed one finished
    # (same commit and arguments). minite.report.rounds: the runs, the resume, the merge and the paired ratios.
    rule bench_learner:
        input:
            arms=per_arm("configs/arms/{arm}.yaml"),
            model=model_inputs("bench_learner"),
        output:
            merged=per_arm(f"{RESULTS}/{{arm}}/learner.json"),
            rounds=[f"{RESULTS}/{arm}/learner_rounds/round{k}.json" for k in range(LEARNER_ROUNDS) for arm in ARMS],
        params:
            args=shlex.quote(job_args("bench_learner")),   # one argument of run-rounds
            plan=" ".join(f"{arm}:{k}" for arm, k in round_plan(ARMS, LEARNER_ROUNDS)),
            arms=" ".join(ARMS),
            rounds=LEARNER_ROUNDS,
            results=RESULTS,
        log:
            f"{LOGS}/bench_learner/rounds.log",
        threads: job_threads("bench_learner")
        resources:
            gpu=job_gpus("bench_learner"),
        shell:
            rounds_shell("learner", minite("bench_learner"))


# Rollout (decode) throughput beside the learner's, for profiles that configure a bench_sampler job.
ROLLOUT = per_arm(f"{RESULTS}/{{arm}}/rollout.json") if "bench_sampler" in config["jobs"] else []
SAMPLER_ROUNDS = int(job("bench_sampler").get("rounds", 1)) if ROLLOUT else 1


if SAMPLER_ROUNDS == 1:

    rule bench_sampler:
        input:
            arm=arm_yaml,
            model=model_inputs("bench_sampler") if ROLLOUT else [],
        output:
            f"{RESULTS}/{{arm}}/rollout.json",
        params:
            args=job_args("bench_sampler") if ROLLOUT else "",
        log:
            f"{LOGS}/bench_sampler/{{arm}}.log",
        threads: job_threads("bench_sampler") if ROLLOUT else 1
        resources:
            gpu=job_gpus("bench_sampler") if ROLLOUT else 0,
        shell:
            "OMP_NUM_THREADS={threads} {PY} -m minite bench-sampler --arm {wildcards.arm} {params.args}"
            " --out {output} > {log} 2>&1"

else:

    # One job for all arms, as bench_learner's rounds (the rollout ratio vs BF16 paired within each round).
    rule bench_sampler:
        input:
            arms=per_arm("configs/arms/{arm}.yaml"),
            model=model_inputs("bench_sampler"),
        output:
            merged=ROLLOUT,
            rounds=[f"{RESULTS}/{arm}/rollout_rounds/round{k}.json" for k in range(SAMPLER_ROUNDS) for arm in ARMS],
        params:
            args=shlex.quote(job_args("bench_sampler")),
            plan=" ".join(f"{arm}:{k}" for arm, k in round_plan(ARMS, SAMPLER_ROUNDS)),
            arms=" ".join(ARMS),
            rounds=SAMPLER_ROUNDS,
            results=RESULTS,
        log:
            f"{LOGS}/bench_sampler/rounds.log",
        threads: job_threads("bench_sampler")
        resources:
            gpu=job_gpus("bench_sampler"),
        shell:
            rounds_shell("sampler", "{PY} -m minite")


# The committed reference run of this profile, set beside the new one in the markdown (read, never written).
REFERENCE_LEARNER = [p for p in per_arm(f"{REFERENCE}/{{arm}}/learner.json") if (REPO / p).is_file()]


rule throughput_table_files:
    input:
        run=per_arm(f"{RESULTS}/{{arm}}/learner.json"),
        rollout=ROLLOUT,
        reference=REFERENCE_LEARNER,
    output:
        csv=report(f"{RESULTS}/throughput_table.csv", caption="../report/throughput_table.rst",
                   category="Throughput"),
        md=f"{RESULTS}/throughput_table.md",
        tex=f"{RESULTS}/throughput_table.tex",
    params:
        arms=" ".join(ARMS),
        results=RESULTS,
        profile=PROFILE,
        prefix=f"{RESULTS}/throughput_table",
        reference=f"--reference {REFERENCE}" if REFERENCE_LEARNER else "",
    log:
        f"{LOGS}/throughput_table.log",
    shell:
        "{PY} -m minite.report table --results {params.results} --arms {params.arms} --profile {params.profile}"
        " {params.reference} --out {params.prefix} > {log} 2>&1"


rule figure_throughput:
    input:
        per_arm(f"{RESULTS}/{{arm}}/learner.json"),
        ROLLOUT,
    output:
        png=report(f"{FIGS}/throughput.png", caption="../report/throughput.rst", category="Throughput"),
        pdf=f"{FIGS}/throughput.pdf",
    params:
        arms=" ".join(ARMS),
        results=RESULTS,
        stem=f"{FIGS}/throughput",
    log:
        f"{LOGS}/figures/throughput.log",
    shell:
        "{PY} -m minite.report figure throughput --results {params.results} --arms {params.arms}"
        " --out {params.stem} > {log} 2>&1"
