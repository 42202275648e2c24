# Figures from the results (png for the report, pdf beside it). `python -m minite.report figure ...`
# reads the results and draws; it recomputes nothing.


rule figure_drift:
    input:
        per_arm(f"{RESULTS}/{{arm}}/stability_summary.json"),
    output:
        png=report(f"{FIGS}/drift.png", caption="../report/drift.rst", category="Stability"),
        pdf=f"{FIGS}/drift.pdf",
    params:
        arms=" ".join(ARMS),
        results=RESULTS,
        smooth=config["smooth"],
        stem=f"{FIGS}/drift",
    log:
        f"{LOGS}/figures/drift.log",
    shell:
        "{PY} -m minite.report figure drift --results {params.results} --arms {params.arms}"
        " --smooth {params.smooth} --out {params.stem} > {log} 2>&1"


rule figure_reward_eval:
    input:
        per_arm(f"{RESULTS}/{{arm}}/stability_summary.json"),
        per_arm(f"{RESULTS}/{{arm}}/evals.csv"),
    output:
        png=report(f"{FIGS}/reward_eval.png", caption="../report/reward_eval.rst", category="Stability"),
        pdf=f"{FIGS}/reward_eval.pdf",
    params:
        arms=" ".join(ARMS),
        results=RESULTS,
        smooth=config["smooth"],
        stem=f"{FIGS}/reward_eval",
    log:
        f"{LOGS}/figures/reward_eval.log",
    shell:
        "{PY} -m minite.report figure reward --results {params.results} --arms {params.arms}"
        " --smooth {params.smooth} --out {params.stem} > {log} 2>&1"


rule figure_kernels:
    input:
        f"{RESULTS}/kernels.csv",
    output:
        png=report(f"{FIGS}/kernels.png", caption="../report/kernels.rst", category="Kernels"),
        pdf=f"{FIGS}/kernels.pdf",
    params:
        results=RESULTS,
        stem=f"{FIGS}/kernels",
    log:
        f"{LOGS}/figures/kernels.log",
    shell:
        "{PY} -m minite.report figure kernels --results {params.results} --out {params.stem} > {log} 2>&1"


rule figure_layers:
    # one heatmap per arm, all on one colour scale (so equal colours mean equal errors across arms)
    input:
        per_arm(f"{RESULTS}/{{arm}}/diagnostics/mismatch.json"),
        per_arm(f"{RESULTS}/{{arm}}/diagnostics/layers.csv"),
    output:
        png=[report(f"{FIGS}/layers_{arm}.png", caption="../report/layers.rst", category="Diagnostics",
                    subcategory=arm) for arm in ARMS],
        pdf=per_arm(f"{FIGS}/layers_{{arm}}.pdf"),
    params:
        arms=" ".join(ARMS),
        results=RESULTS,
        stem=f"{FIGS}/layers",
    log:
        f"{LOGS}/figures/layers.log",
    shell:
        "{PY} -m minite.report figure layers --results {params.results} --arms {params.arms}"
        " --out {params.stem} > {log} 2>&1"


rule figure_attribution:
    input:
        f"{RESULTS}/{ATTRIBUTION_ARM}/diagnostics/attribution.csv",
    output:
        png=report(f"{FIGS}/attribution.png", caption="../report/attribution.rst", category="Diagnostics"),
        pdf=f"{FIGS}/attribution.pdf",
    params:
        results=RESULTS,
        arm=ATTRIBUTION_ARM,
        stem=f"{FIGS}/attribution",
    log:
        f"{LOGS}/figures/attribution.log",
    shell:
        "{PY} -m minite.report figure attribution --results {params.results} --arms {params.arm}"
        " --out {params.stem} > {log} 2>&1"
