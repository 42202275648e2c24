# The drift study's runs beside the per-arm ones: RL runs of further seeds, the placement of the runs on the
# GPUs of one machine, the accuracy/stability table (results_table) and the study figure.
#
# Runs: every arm of `arms` with seed 0 (results/<profile>/<arm>/, the rules of rl.smk), plus `extra_seeds`
# (results/<profile>/<arm>_seed<N>/, the same warm start, `--seed N`; minite.report.load.run_name). With
# `gpus: N` >= 2 the runs are placed round-robin in that order, run k on cuda:(k mod N) (its eval job too), and
# the profile's `resources: gpu` caps how many GPU jobs run at once (several per GPU when they fit).
from minite.report.load import run_name

EXTRA_SEEDS = {arm: list(seeds) for arm, seeds in config["extra_seeds"].items()}
_not_arms = sorted(set(EXTRA_SEEDS) - set(ARMS))
if _not_arms:
    raise WorkflowError(f"extra_seeds names arms that are not in `arms`: {_not_arms}")
SEED_RUNS = [run_name(arm, seed) for arm in ARMS for seed in EXTRA_SEEDS.get(arm, [])]
RUNS = ARMS + SEED_RUNS
RESULTS_TABLE = multiext(f"{RESULTS}/results_table", ".csv", ".md", ".tex")
FIG_STUDY = multiext(f"{FIGS}/drift_study", ".png", ".pdf")


wildcard_constraints:
    seed=r"[1-9][0-9]*",


def placed_args(name: str, run: str) -> str:
    """job_args of an RL-run job (rl, eval) with its run's GPU: --device cuda:(k mod gpus) for run k of RUNS
    when the profile has 2 or more GPUs; the plain job_args otherwise."""
    gpus = int(config["gpus"])
    if gpus < 2:
        return job_args(name)
    return job_args(name, device=f"cuda:{RUNS.index(run) % gpus}")


def run_outputs(run: str) -> list[str]:
    """What a finished run leaves that the table and figure read: its summary, and its evals.csv unless the
    held-out accuracy is measured inside the run (`heldout: in_run`)."""
    files = [f"{RESULTS}/{run}/stability_summary.json"]
    if config["heldout"] == "eval_job":
        files.append(f"{RESULTS}/{run}/evals.csv")
    return files


use rule rl as rl_seed with:
    output:
        f"{RESULTS}/{{arm}}_seed{{seed}}/stability_summary.json",
    params:
        args=lambda wc: placed_args("rl", run_name(wc.arm, wc.seed)) + f" --seed {wc.seed}",
        init=f"{RESULTS}/sft",
        out=lambda wc: f"{RESULTS}/{run_name(wc.arm, wc.seed)}",
    log:
        f"{LOGS}/rl/{{arm}}_seed{{seed}}.log",


use rule eval as eval_seed with:
    input:
        arm=arm_yaml,
        model=model_inputs("eval"),
        run=f"{RESULTS}/{{arm}}_seed{{seed}}/stability_summary.json",
    output:
        f"{RESULTS}/{{arm}}_seed{{seed}}/evals.csv",
    params:
        args=lambda wc: placed_args("eval", run_name(wc.arm, wc.seed)) + f" --seed {wc.seed}",
        run=lambda wc: f"{RESULTS}/{run_name(wc.arm, wc.seed)}",
    log:
        f"{LOGS}/eval/{{arm}}_seed{{seed}}.log",


rule results_table_files:
    input:
        [f for run in RUNS for f in run_outputs(run)],
    output:
        csv=report(f"{RESULTS}/results_table.csv", caption="../report/results_table.rst", category="Stability"),
        md=f"{RESULTS}/results_table.md",
        tex=f"{RESULTS}/results_table.tex",
    params:
        runs=" ".join(RUNS),
        results=RESULTS,
        profile=PROFILE,
        prefix=f"{RESULTS}/results_table",
    log:
        f"{LOGS}/results_table.log",
    shell:
        "{PY} -m minite.report results-table --results {params.results} --arms {params.runs}"
        " --profile {params.profile} --out {params.prefix} > {log} 2>&1"


rule figure_drift_study:
    input:
        [f for run in RUNS for f in run_outputs(run)],
    output:
        png=report(f"{FIGS}/drift_study.png", caption="../report/drift_study.rst", category="Stability"),
        pdf=f"{FIGS}/drift_study.pdf",
    params:
        runs=" ".join(RUNS),
        results=RESULTS,
        smooth=config["smooth"],
        stem=f"{FIGS}/drift_study",
    log:
        f"{LOGS}/figures/drift_study.log",
    shell:
        "{PY} -m minite.report figure study --results {params.results} --arms {params.runs}"
        " --smooth {params.smooth} --out {params.stem} > {log} 2>&1"


rule results_table:
    input:
        RESULTS_TABLE,


rule drift_study:
    input:
        RESULTS_TABLE,
        FIG_STUDY,
        FIG_DRIFT,
