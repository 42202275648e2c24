# Notebooks (notebooks/*.ipynb, papermill-parameterised with `results_dir` and `arms`) executed into
# results/<profile>/notebooks/. They read the results and plot; they never recompute. `reference_dir` is the
# profile's committed reference run (results/reference/<profile>), shown beside the new run where it exists.


def notebook_inputs(wildcards):
    learner = per_arm(f"{RESULTS}/{{arm}}/learner.json")
    return {
        "drift": per_arm(f"{RESULTS}/{{arm}}/stability_summary.json") + per_arm(f"{RESULTS}/{{arm}}/evals.csv"),
        "throughput": learner + ([f"{RESULTS}/kernels.csv"] if config["gpu"] else []),
        "diagnostics": per_arm(f"{RESULTS}/{{arm}}/diagnostics/mismatch.json")
        + per_arm(f"{RESULTS}/{{arm}}/diagnostics/layers.csv")
        + [f"{RESULTS}/{ATTRIBUTION_ARM}/diagnostics/attribution.csv"],
    }[wildcards.nb]


rule notebook:
    input:
        nb="notebooks/{nb}.ipynb",
        results=notebook_inputs,
    output:
        report(f"{RESULTS}/notebooks/{{nb}}.ipynb", caption="../report/notebooks.rst", category="Notebooks"),
    wildcard_constraints:
        nb="|".join(NOTEBOOKS),
    params:
        arms="[" + ", ".join(ARMS) + "]",
        results=RESULTS,
        reference=REFERENCE,
    log:
        f"{LOGS}/notebooks/{{nb}}.log",
    shell:
        "{PY} -m papermill {input.nb} {output} -k python3 -p results_dir {params.results}"
        " -p reference_dir {params.reference} -y 'arms: {params.arms}' --no-progress-bar > {log} 2>&1"
