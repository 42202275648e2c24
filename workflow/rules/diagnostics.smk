# Trainer/sampler mismatch diagnostics per arm (mismatch, per-layer localisation, cause attribution).


rule diagnose:
    input:
        arm=arm_yaml,
        model=model_inputs("diagnose"),
    output:
        mismatch=f"{RESULTS}/{{arm}}/diagnostics/mismatch.json",
        layers=f"{RESULTS}/{{arm}}/diagnostics/layers.csv",
        attribution=f"{RESULTS}/{{arm}}/diagnostics/attribution.csv",
    params:
        args=job_args("diagnose"),
        out=lambda wc: f"{RESULTS}/{wc.arm}/diagnostics",
    log:
        f"{LOGS}/diagnose/{{arm}}.log",
    threads: job_threads("diagnose")
    resources:
        gpu=job_gpus("diagnose"),
    shell:
        "OMP_NUM_THREADS={threads} {PY} -m minite diagnose --arm {wildcards.arm} {params.args}"
        " --out {params.out} > {log} 2>&1"
