# NVFP4 kernel check + timing (GPU: the job fails with a clear error without one).


rule kernel_bench_csv:
    input:
        job("kernel_bench").get("inputs", []),
    output:
        csv=report(f"{RESULTS}/kernels.csv", caption="../report/kernels_table.rst", category="Kernels"),
        md=f"{RESULTS}/kernels.md",  # kernel-bench's summary (checks + timings), written beside the csv
    params:
        args=job_args("kernel_bench"),
    log:
        f"{LOGS}/kernel_bench.log",
    threads: job_threads("kernel_bench")
    resources:
        gpu=job_gpus("kernel_bench"),
    shell:
        "{PY} -m minite kernel-bench {params.args} --out {output.csv} > {log} 2>&1"
