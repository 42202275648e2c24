# Named targets. `all` is the default (first rule). GPU-only outputs (kernel_bench) join `all` and
# `figures` only when the profile says `gpu: true`.

THROUGHPUT = multiext(f"{RESULTS}/throughput_table", ".csv", ".md", ".tex")
FIG_THROUGHPUT = multiext(f"{FIGS}/throughput", ".png", ".pdf")
FIG_DRIFT = multiext(f"{FIGS}/drift", ".png", ".pdf")
FIG_REWARD = multiext(f"{FIGS}/reward_eval", ".png", ".pdf")
FIG_KERNELS = multiext(f"{FIGS}/kernels", ".png", ".pdf")
FIG_DIAG = [*multiext(f"{FIGS}/attribution", ".png", ".pdf"), *per_arm(f"{FIGS}/layers_{{arm}}.png"),
            *per_arm(f"{FIGS}/layers_{{arm}}.pdf")]
NOTEBOOKS = ["drift", "throughput", "diagnostics"]
GPU_ONLY = [f"{RESULTS}/kernels.csv", *FIG_KERNELS] if config["gpu"] else []


rule all:
    input:
        THROUGHPUT,
        FIG_THROUGHPUT,
        per_arm(f"{RESULTS}/{{arm}}/stability_summary.json"),
        per_arm(f"{RESULTS}/{{arm}}/evals.csv"),
        per_arm(f"{RESULTS}/{{arm}}/diagnostics/mismatch.json"),
        FIG_DRIFT,
        FIG_REWARD,
        FIG_DIAG,
        GPU_ONLY,
        expand(f"{RESULTS}/notebooks/{{nb}}.ipynb", nb=NOTEBOOKS),
    default_target: True


rule throughput_table:
    input:
        THROUGHPUT,
        FIG_THROUGHPUT,


rule stability:
    input:
        per_arm(f"{RESULTS}/{{arm}}/stability_summary.json"),
        FIG_DRIFT,


rule evals:
    input:
        per_arm(f"{RESULTS}/{{arm}}/evals.csv"),
        FIG_REWARD,


rule diagnostics:
    input:
        per_arm(f"{RESULTS}/{{arm}}/diagnostics/mismatch.json"),
        FIG_DIAG,


rule kernel_bench:
    input:
        f"{RESULTS}/kernels.csv",
        FIG_KERNELS,


rule figures:
    input:
        FIG_THROUGHPUT,
        FIG_DRIFT,
        FIG_REWARD,
        FIG_DIAG,
        FIG_KERNELS if config["gpu"] else [],


rule notebooks:
    input:
        expand(f"{RESULTS}/notebooks/{{nb}}.ipynb", nb=NOTEBOOKS),
