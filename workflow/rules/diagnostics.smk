# Trainer/sampler mismatch diagnostics per arm: mismatch.json (token-level metrics) and layers.csv
# (per-layer/op localisation). The cause attribution (naive -> aligned, one engine difference at a time,
# 16 measured cause subsets of naive_te_nvfp4) is the same table whichever arm asks for it, so only one arm computes it:
# ATTRIBUTION_ARM (the naive arm when configured), through its own rule.

ATTRIBUTION_ARM = "naive_te_nvfp4" if "naive_te_nvfp4" in ARMS else ARMS[0]


def diagnose_inputs(wildcards):
    files = {"arm": arm_yaml(wildcards), "model": model_inputs("diagnose")}
    if job("diagnose").get("init_from_sft"):
        files["sft"] = SFT_OUTPUTS
    return files


DIAGNOSE_INIT = f"--checkpoint {RESULTS}/sft" if job("diagnose").get("init_from_sft") else ""


def diagnose_cmd(attribution: str) -> str:
    return ("OMP_NUM_THREADS={threads} {PY} -m minite diagnose --arm {wildcards.arm} {params.args} {params.init}"
            f" --attribution {attribution} --out {{params.out}} > {{log}} 2>&1")


rule diagnose:
    input:
        unpack(diagnose_inputs),
    output:
        mismatch=f"{RESULTS}/{{arm}}/diagnostics/mismatch.json",
        layers=f"{RESULTS}/{{arm}}/diagnostics/layers.csv",
    params:
        args=job_args("diagnose"),
        init=DIAGNOSE_INIT,
        out=lambda wc: f"{RESULTS}/{wc.arm}/diagnostics",
    log:
        f"{LOGS}/diagnose/{{arm}}.log",
    threads: job_threads("diagnose")
    resources:
        gpu=job_gpus("diagnose"),
    shell:
        diagnose_cmd("off")


rule diagnose_with_attribution:
    input:
        unpack(diagnose_inputs),
    output:
        mismatch=f"{RESULTS}/{{arm}}/diagnostics/mismatch.json",
        layers=f"{RESULTS}/{{arm}}/diagnostics/layers.csv",
        attribution=f"{RESULTS}/{{arm}}/diagnostics/attribution.csv",
    wildcard_constraints:
        arm=re.escape(ATTRIBUTION_ARM),
    params:
        args=job_args("diagnose"),
        init=DIAGNOSE_INIT,
        out=lambda wc: f"{RESULTS}/{wc.arm}/diagnostics",
    log:
        f"{LOGS}/diagnose/{{arm}}.log",
    threads: job_threads("diagnose")
    resources:
        gpu=job_gpus("diagnose"),
    shell:
        diagnose_cmd("on")


ruleorder: diagnose_with_attribution > diagnose
