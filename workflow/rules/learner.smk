# Learner throughput: bench-learner per arm, then the table (csv/md/tex) and the bar figure.


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
        "OMP_NUM_THREADS={threads} " + minite("bench_learner") + " bench-learner --arm {wildcards.arm} {params.args}"
        " --out {output} > {log} 2>&1"


# The committed reference run of this profile, set beside the new one in the markdown (read, never written).
REFERENCE_LEARNER = [p for p in per_arm(f"{REFERENCE}/{{arm}}/learner.json") if (REPO / p).is_file()]


rule throughput_table_files:
    input:
        run=per_arm(f"{RESULTS}/{{arm}}/learner.json"),
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
