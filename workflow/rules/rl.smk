# SFT warm start (shared by all arms), long-horizon GRPO per arm, held-out evals per arm.
#
# The RL job is resumable: its checkpoints (<arm>/ckpt/) and step log (<arm>/stability.jsonl) are not
# declared outputs, so snakemake never deletes them; only stability_summary.json (written at the end) is.
# A killed run therefore resumes from its last checkpoint when the target is requested again, and raising
# `steps` in the config (a params change) extends the run instead of restarting it.
# A job the profile gives more than one GPU (`jobs.<job>.gpu`) runs under torchrun, one process per GPU.


# The warm start is done when its weights exist (sft.json alone is not enough: the weights are large and may
# have been deleted or never copied). A profile whose RL config trains no SFT and loads the model's own
# checkpoint sets `jobs.sft.weights: false`; then sft.json alone marks it done.
SFT_OUTPUTS = [f"{RESULTS}/sft/sft.json"] + ([f"{RESULTS}/sft/weights/config.json"]
                                             if job("sft").get("weights", True) else [])


rule sft:
    input:
        model_inputs("sft"),
    output:
        SFT_OUTPUTS,
    params:
        args=job_args("sft"),
        out=f"{RESULTS}/sft",
    log:
        f"{LOGS}/sft.log",
    threads: job_threads("sft")
    resources:
        gpu=job_gpus("sft"),
    shell:
        "OMP_NUM_THREADS={threads} " + minite("sft") + " sft {params.args} --out {params.out} > {log} 2>&1"


rule rl:
    input:
        arm=arm_yaml,
        model=model_inputs("rl"),
        sft=SFT_OUTPUTS,
    output:
        f"{RESULTS}/{{arm}}/stability_summary.json",
    params:
        args=lambda wc: placed_args("rl", wc.arm),
        init=f"{RESULTS}/sft",
        out=lambda wc: f"{RESULTS}/{wc.arm}",
    log:
        f"{LOGS}/rl/{{arm}}.log",
    threads: job_threads("rl")
    resources:
        gpu=job_gpus("rl"),
    shell:
        "OMP_NUM_THREADS={threads} " + minite("rl") + " rl --arm {wildcards.arm} {params.args}"
        " --checkpoint {params.init} --out {params.out} >> {log} 2>&1"


rule eval:
    input:
        arm=arm_yaml,
        model=model_inputs("eval"),
        run=rules.rl.output,
    output:
        f"{RESULTS}/{{arm}}/evals.csv",
    params:
        args=lambda wc: placed_args("eval", wc.arm),
        run=lambda wc: f"{RESULTS}/{wc.arm}",
    log:
        f"{LOGS}/eval/{{arm}}.log",
    threads: job_threads("eval")
    resources:
        gpu=job_gpus("eval"),
    shell:
        "OMP_NUM_THREADS={threads} " + minite("eval") + " eval --arm {wildcards.arm} {params.args}"
        " --run-dir {params.run} --out {output} > {log} 2>&1"
