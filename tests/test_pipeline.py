"""The Snakemake pipeline: dry-runs of every named target (cpu and h200 profiles; multi-GPU jobs under torchrun in
the h200x2, b300 and Slurm profiles), config validation, single-arm reruns, and the README's first command on a
fresh clone, end to end on CPU (slow).

Dry-runs work on a copy of the workflow files in a temporary directory, so results, .snakemake metadata
and touched config files never land in the checkout.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
TARGETS = ["throughput_table", "stability", "evals", "diagnostics", "kernel_bench", "figures", "notebooks", "all"]
ARMS = ["bf16", "naive_te_nvfp4", "minite_nvfp4"]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


@pytest.fixture
def wf(tmp_path):
    """A copy of the workflow (Snakefile, workflow/, configs/, notebooks/) to run snakemake in."""
    for name in ("Snakefile", "workflow", "configs", "notebooks"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / name)
    return tmp_path


def smk(wf, *args, check=True):
    """snakemake in the copy; its jobs run the installed minite (pip install -e .) with this interpreter."""
    r = subprocess.run([*SNAKEMAKE, "--nocolor", *args], cwd=wf, capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({r.returncode}):\n"
                             f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def job_counts(out: str) -> dict[str, int]:
    """The 'Job stats' table of a dry-run: rule -> number of jobs."""
    table = out.split("Job stats:", 1)[1].split("Reasons:", 1)[0] if "Job stats:" in out else ""
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}
    jobs.pop("total", None)
    return jobs


def dry(wf, *args):
    r = smk(wf, "-n", *args, "--quiet", "rules")
    return job_counts(r.stdout + r.stderr)


def test_dry_run_every_target_cpu(wf):
    """All named targets in one dry-run (one DAG; any target that cannot be built fails it)."""
    jobs = dry(wf, *TARGETS)
    assert all(jobs.get(t) == 1 for t in TARGETS), jobs
    # one job per configured arm; the attribution runs once, inside one arm's diagnose
    assert jobs["bench_learner"] == jobs["rl"] == jobs["eval"] == 3
    assert jobs["figure_layers"] == 1                      # all arms' heatmaps at once: one colour scale
    assert jobs["diagnose"] + jobs["diagnose_with_attribution"] == 3 and jobs["diagnose_with_attribution"] == 1
    assert jobs["sft"] == 1 and jobs["notebook"] == 3 and jobs["kernel_bench_csv"] == 1


def test_all_on_cpu_leaves_out_the_gpu_kernel_bench(wf):
    jobs = dry(wf, "all")
    assert "kernel_bench_csv" not in jobs and "figure_kernels" not in jobs
    assert jobs["throughput_table_files"] == 1 and jobs["figure_drift"] == 1 and jobs["notebook"] == 3


def test_dry_run_h200_profile(wf):
    r = smk(wf, "-n", "-p", "all", "--profile", "workflow/profiles/h200")
    jobs = job_counts(r.stdout)
    # the learner in 3 rounds over the arms: one job
    assert jobs.get("kernel_bench_csv") == 1 and jobs.get("bench_learner") == 1 and jobs.get("rl") == 3
    assert "results/h200/minite_nvfp4/learner.json" in r.stdout and "--rounds 3" in r.stdout
    # the throughput slice: Qwen3-30B-A3B, 2 layers, 16 x 2048 tokens per update, on the GPU
    cmd = next(ln for ln in r.stdout.splitlines() if "minite.report run-rounds --bench learner" in ln)
    for flag in ("--model qwen3_30b_a3b", "--layers 2", "--seq-len 2048", "--tokens-per-update 32768",
                 "--device cuda"):
        assert flag in cmd, cmd


def test_dry_run_b300_profile_parses(wf):
    assert dry(wf, "throughput_table", "--profile", "workflow/profiles/b300").get("bench_learner") == 3


def test_multi_gpu_jobs_run_under_torchrun(wf):
    """A job the profile gives N > 1 GPUs runs as N processes (torchrun through this interpreter); one-GPU jobs
    and jobs that run in one process (diagnose) do not."""
    r = smk(wf, "-n", "-p", "all", "--profile", "workflow/profiles/h200x2")
    lines = r.stdout.splitlines()
    for job in ("bench-learner --arm bf16", "sft --model small", "rl --arm bf16", "eval --arm bf16"):
        cmd = next(ln for ln in lines if f"-m minite {job}" in ln)
        assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m minite" in cmd, cmd
    assert "--layers 4" in next(ln for ln in lines if "bench-learner --arm bf16" in ln)
    assert "--run-dir results/h200x2/bf16 " in next(ln for ln in lines if "-m minite eval --arm bf16" in ln)
    for job in ("diagnose --arm bf16", "kernel-bench"):
        cmd = next(ln for ln in lines if f"-m minite {job}" in ln)
        assert "torch.distributed.run" not in cmd, cmd
    b300 = smk(wf, "-n", "-p", "throughput_table", "--profile", "workflow/profiles/b300").stdout
    assert "--nproc-per-node 8 -m minite bench-learner" in b300 and "--layers 48" in b300


def test_slurm_cluster_profile_dry_run(wf):
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="the optional extra .[slurm]")
    r = smk(wf, "-n", "-p", "throughput_table", "stability", "--profile", "workflow/profiles/slurm")
    assert job_counts(r.stdout).get("rl") == 3 and "results/b300/" in r.stdout
    assert "--nproc-per-node 8 -m minite rl" in r.stdout


def test_config_profile_switch_and_results_dir(wf):
    r = smk(wf, "-n", "-p", "throughput_table", "--config", "profile=h200")
    assert "results/h200/throughput_table.csv" in r.stdout and "results/cpu" not in r.stdout


def test_single_arm_by_config(wf):
    r = smk(wf, "-n", "-p", "throughput_table", "--config", "arms=[minite_nvfp4]")
    assert job_counts(r.stdout).get("bench_learner") == 1
    assert "--arm minite_nvfp4" in r.stdout and "--arm bf16" not in r.stdout


def test_single_arm_by_output(wf):
    r = smk(wf, "-n", "-p", "results/cpu/naive_te_nvfp4/learner.json")
    assert job_counts(r.stdout) == {"bench_learner": 1}
    assert "--arm naive_te_nvfp4" in r.stdout


def test_editing_one_arm_yaml_reruns_only_that_arm(wf):
    old = time.time() - 3600
    for p in (wf / "configs").rglob("*.yaml"):
        os.utime(p, (old, old))
    for arm in ARMS:                                        # pretend every arm was benchmarked already
        for name in ("learner.json", "rollout.json"):
            out = wf / "results" / "cpu" / arm / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("{}")
    for ext in ("csv", "md", "tex"):
        (wf / "results" / "cpu" / f"throughput_table.{ext}").write_text("x")
    (wf / "results" / "cpu" / "figures").mkdir()
    for ext in ("png", "pdf"):
        (wf / "results" / "cpu" / "figures" / f"throughput.{ext}").write_text("x")
    r = smk(wf, "-n", "-p", "throughput_table", "--rerun-triggers", "mtime")
    assert "Nothing to be done" in r.stdout + r.stderr
    os.utime(wf / "configs" / "arms" / "bf16.yaml")         # edit one arm
    r = smk(wf, "-n", "-p", "throughput_table", "--rerun-triggers", "mtime")
    jobs = job_counts(r.stdout)
    assert jobs.get("bench_learner") == 1 and jobs.get("bench_sampler") == 1
    assert "--arm bf16" in r.stdout and "--arm minite_nvfp4" not in r.stdout
    assert jobs.get("throughput_table_files") == 1         # the table is rebuilt from the new row


def test_job_flags_come_from_the_config(wf):
    r = smk(wf, "-n", "-p", "results/cpu/bf16/learner.json", "--config", "profile=cpu")
    assert "--model tiny --device cpu --steps 30 --warmup 3" in r.stdout
    # a --configfile holding only the keys to change; a mapping renders as a repeated KEY=VALUE flag
    (wf / "more.yaml").write_text("jobs:\n  rl:\n    args:\n      steps: 7\n"
                                  "      set: {rl.group_size: 8, rl.lr: 1.0e-5}\n")
    r = smk(wf, "-n", "-p", "results/cpu/bf16/stability_summary.json", "--configfile", "more.yaml")
    cmd = next(ln for ln in r.stdout.splitlines() if "minite rl --arm bf16" in ln)
    assert "--steps 7 --ckpt-every 10 --set rl.group_size=8 --set rl.lr=1e-05" in cmd
    assert "--checkpoint results/cpu/sft --out results/cpu/bf16" in cmd


def test_sft_is_done_only_when_its_weights_exist(wf):
    """sft.json without the weights (deleted, or never copied) is not a finished warm start: the RL jobs
    would fail on it, so the pipeline reruns sft first."""
    sft = wf / "results" / "cpu" / "sft"
    sft.mkdir(parents=True)
    (sft / "sft.json").write_text("{}")
    assert dry(wf, "results/cpu/bf16/stability_summary.json").get("sft") == 1
    (sft / "weights").mkdir()
    (sft / "weights" / "config.json").write_text("{}")
    assert "sft" not in dry(wf, "results/cpu/bf16/stability_summary.json", "--rerun-triggers", "mtime")
    # a profile whose RL config trains no SFT (the model's own checkpoint): sft.json alone marks it done
    assert "weights" not in smk(wf, "-n", "-p", "results/b300/sft/sft.json", "--profile",
                                "workflow/profiles/b300").stdout.split("rule sft:")[1].split("rule ")[0]


def test_reference_runs_are_read_only(wf):
    r = smk(wf, "-n", "throughput_table", "--config", "results=results/reference/cpu", check=False)
    assert r.returncode != 0 and "read-only" in r.stdout + r.stderr


def test_table_sets_the_reference_run_beside(wf):
    r = smk(wf, "-n", "-p", "throughput_table")
    assert "--reference" not in r.stdout                    # no reference run of this profile here
    for arm in ARMS:
        ref = wf / "results" / "reference" / "cpu" / arm / "learner.json"
        ref.parent.mkdir(parents=True)
        ref.write_text("{}")
    r = smk(wf, "-n", "-p", "throughput_table")
    cmd = next(ln for ln in r.stdout.splitlines() if "minite.report table" in ln)
    assert "--reference results/reference/cpu" in cmd and "--results results/cpu" in cmd
    assert "bench_learner" in job_counts(r.stdout)           # a reference never stands in for a measurement


def test_recorded_paths_are_relative(wf):
    """Inputs and params name files relative to the repository: nothing a run records names the machine."""
    r = smk(wf, "-n", "-p", "all")
    jobs = r.stdout.split("Building DAG of jobs...", 1)[1]   # after snakemake's own header (it names its dirs)
    assert "input: configs/arms/" in jobs and "notebooks/drift.ipynb" in jobs
    assert str(wf) not in jobs


@pytest.mark.parametrize("config, message", [
    (["arms=[bf16,nope]"], "unknown arm"),
    (["profile=nope"], "unknown profile"),
    (["smooth=0"], "minimum"),
    (["typo_key=1"], "Additional properties"),
])
def test_bad_config_is_a_clear_error(wf, config, message):
    r = smk(wf, "-n", "throughput_table", "--config", *config, check=False)
    assert r.returncode != 0 and message in r.stdout + r.stderr


def test_broken_arm_or_model_yaml_fails_the_dry_run(wf):
    """A configured arm or model that its job would refuse fails when the pipeline is parsed, not after the
    jobs before it (the SFT warm start) have run."""
    arm = (wf / "configs" / "arms" / "bf16.yaml").read_text().replace("gemm: bf16", "gemm: fast", 1)
    assert "gemm: fast" in arm
    (wf / "configs" / "arms" / "broken.yaml").write_text(arm)
    r = smk(wf, "-n", "stability", "--config", "arms=[broken]", check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "config 'arms'" in out and "fast" in out
    bad = wf / "bad_model.yaml"
    bad.write_text((wf / "configs" / "models" / "tiny.yaml").read_text().replace("hidden_size: 128",
                                                                                 'hidden_size: "abc"'))
    r = smk(wf, "-n", "stability", "--config", f"jobs={{rl: {{model: {bad}}}}}", check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "jobs.rl.model" in out and "hidden_size" in out, out[-2000:]


def test_unknown_arm_output_is_not_a_target(wf):
    r = smk(wf, "-n", "results/cpu/fp8/learner.json", check=False)
    assert r.returncode != 0 and "MissingRuleException" in r.stdout + r.stderr


def _rounds_config(wf, rounds: int, **args) -> str:
    path = wf / "rounds.yaml"
    path.write_text(f"jobs:\n  bench_learner:\n    rounds: {rounds}\n"
                    + (f"    args: {{{', '.join(f'{k}: {v}' for k, v in args.items())}}}\n" if args else ""))
    return str(path)


def test_learner_rounds_are_one_job_in_rotated_order(wf):
    """`rounds: 3`: one bench_learner job runs every arm once per round, round k starting at arm k, into
    learner_rounds/round<k>.json (minite.report.rounds.run_rounds), then merges them into each arm's
    learner.json; rounds: 0 is refused."""
    r = smk(wf, "-n", "-p", "throughput_table", "--configfile", _rounds_config(wf, 3))
    assert job_counts(r.stdout + r.stderr)["bench_learner"] == 1
    assert ("minite.report run-rounds --bench learner --results results/cpu --plan 'bf16:0 naive_te_nvfp4:0 "
            "minite_nvfp4:0 naive_te_nvfp4:1 minite_nvfp4:1 bf16:1 minite_nvfp4:2 bf16:2 naive_te_nvfp4:2' --runner '"
            ) in r.stdout
    assert ("minite.report merge-rounds --bench learner --results results/cpu --arms bf16 naive_te_nvfp4 "
            "minite_nvfp4 --rounds 3") in r.stdout
    bad = smk(wf, "-n", "throughput_table", "--configfile", _rounds_config(wf, 0), check=False)
    assert bad.returncode != 0 and "minimum" in bad.stdout + bad.stderr


def test_rollout_rounds_are_one_job_in_rotated_order(wf):
    """`rounds: 2` in the bench_sampler job: one job runs bench-sampler for every arm once per round
    (minite.report.run-rounds --bench sampler), then merges each arm's rollout.json."""
    path = wf / "sampler_rounds.yaml"
    path.write_text("jobs:\n  bench_sampler:\n    rounds: 2\n")
    r = smk(wf, "-n", "-p", "throughput_table", "--configfile", str(path))
    assert job_counts(r.stdout + r.stderr)["bench_sampler"] == 1
    assert ("minite.report run-rounds --bench sampler --results results/cpu --plan 'bf16:0 naive_te_nvfp4:0 "
            "minite_nvfp4:0 naive_te_nvfp4:1 minite_nvfp4:1 bf16:1' --runner '") in r.stdout
    assert ("minite.report merge-rounds --bench sampler --results results/cpu --arms bf16 naive_te_nvfp4 "
            "minite_nvfp4 --rounds 2") in r.stdout


@pytest.mark.slow
def test_learner_rounds_run_and_pair_the_ratios(wf):
    """Two rounds of the tiny model on CPU end to end: every round's record, the merged learner.json of each
    arm, and a table whose ratios are paired per round."""
    cfg = _rounds_config(wf, 2, device="cpu", steps=5, warmup=1)
    smk(wf, "--cores", "2", "throughput_table", "--configfile", cfg)
    res = wf / "results" / "cpu"
    for arm in ARMS:
        rec = json.loads((res / arm / "learner.json").read_text())
        assert [r["round"] for r in rec["rounds"]] == [0, 1] and rec["median_round"] in (0, 1)
        assert rec == {**json.loads((res / arm / "learner_rounds" / f"round{rec['median_round']}.json")
                                    .read_text()), **{k: rec[k] for k in ("rounds", "median_round", "rounds_note")}}
    assert not (res / ".partial").exists()              # a finished job keeps no copies for a resume
    df = pd.read_csv(res / "throughput_table.csv").set_index("arm")
    assert (df["n_rounds"] == 2).all()
    t = {arm: [r["tokens_per_s"] for r in json.loads((res / arm / "learner.json").read_text())["rounds"]]
         for arm in ARMS}
    per_round = [m / b for m, b in zip(t["minite_nvfp4"], t["bf16"], strict=True)]
    assert df.loc["minite_nvfp4", "ratio_vs_bf16_lo"] == pytest.approx(min(per_round))
    assert df.loc["minite_nvfp4", "ratio_vs_bf16_hi"] == pytest.approx(max(per_round))


@pytest.mark.slow
def test_rollout_rounds_run_and_pair_the_ratio(wf):
    """Two rounds of bench-sampler (tiny model, CPU) end to end: each arm's rollout.json is one of its rounds'
    records with both rounds listed, and the table's rollout ratio is paired per round."""
    path = wf / "sampler_rounds.yaml"
    path.write_text("jobs:\n  bench_sampler:\n    rounds: 2\n    args: {device: cpu, batch: 4, prompt-len: 8, "
                    "new-tokens: 8}\n  bench_learner:\n    args: {device: cpu, steps: 5, warmup: 1}\n")
    smk(wf, "--cores", "2", "throughput_table", "--configfile", str(path))
    res = wf / "results" / "cpu"
    steps = {}
    for arm in ARMS:
        rec = json.loads((res / arm / "rollout.json").read_text())
        assert [r["round"] for r in rec["rounds"]] == [0, 1] and rec["median_round"] in (0, 1)
        assert rec["step_ms"] == json.loads((res / arm / "rollout_rounds" / f"round{rec['median_round']}.json")
                                            .read_text())["step_ms"]
        steps[arm] = [r["step_ms"]["median"] for r in rec["rounds"]]
    assert not (res / ".partial").exists()
    df = pd.read_csv(res / "throughput_table.csv").set_index("arm")
    assert (df["rollout_rounds"] == 2).all()
    per_round = [b / m for m, b in zip(steps["minite_nvfp4"], steps["bf16"], strict=True)]
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16_lo"] == pytest.approx(min(per_round))
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16_hi"] == pytest.approx(max(per_round))


@pytest.mark.slow
def test_fresh_clone_measures_and_leaves_the_tree_clean(tmp_path):
    """The README's first command on a fresh clone: `snakemake --cores 2 throughput_table` measures all three
    arms with this commit's code (provenance sha = the clone's HEAD, not dirty), writes only git-ignored
    files, and is up to date afterwards; its HTML report builds."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True,
                          check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "MINITE_GIT_SHA"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # the jobs run the installed minite (pip install -e . of this checkout: the clone's commit, as CI has it)

    def run(*args, timeout=600):
        r = subprocess.run([*SNAKEMAKE, "--nocolor", *args], cwd=clone, capture_output=True, text=True,
                           env=env, timeout=timeout)
        assert r.returncode == 0, f"snakemake {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    t0 = time.perf_counter()
    r = run("--cores", "2", "throughput_table")
    elapsed = time.perf_counter() - t0
    assert job_counts(r.stdout + r.stderr).get("bench_learner") == 3   # measured, not re-plotted
    res = clone / "results" / "cpu"
    df = pd.read_csv(res / "throughput_table.csv")
    assert list(df.columns) == [
        "arm", "tokens_per_s", "tokens_per_s_q25", "tokens_per_s_q75", "n_steps", "spread", "n_rounds",
        "round_spread", "flag",
        "ratio_vs_bf16", "ratio_vs_bf16_lo", "ratio_vs_bf16_hi", "ratio_vs_naive", "ratio_vs_naive_lo",
        "ratio_vs_naive_hi", "step_ms", "peak_mem_gb", "device", "model", "layers", "sha", "torch", "triton",
        "gpu_driver", "rollout_tokens_per_s", "rollout_ratio_vs_bf16", "rollout_ratio_vs_bf16_lo",
        "rollout_ratio_vs_bf16_hi", "rollout_rounds", "rollout_roofline_frac", "rollout_step_ms", "rollout_flag",
        "rollout_sha", "split_quantize_ms", "split_gemm_ms", "split_other_ms", "split_optimizer_ms", "split_step_ms",
        "quant_share"]
    assert list(df["arm"]) == ARMS and (df["tokens_per_s"] > 0).all() and (df["n_steps"] == 30).all()
    share = df.set_index("arm")["quant_share"]                          # the split, from the --split-steps updates
    assert share["bf16"] == 0.0 and (share[["naive_te_nvfp4", "minite_nvfp4"]] > 0).all()
    assert (df["n_rounds"] == 1).all() and df["round_spread"].isna().all()   # the cpu profile: one run per arm
    assert job_counts(r.stdout + r.stderr).get("bench_sampler") == 3   # the rollout columns, measured too
    assert (df["rollout_tokens_per_s"] > 0).all() and (df["rollout_roofline_frac"] > 0).all()
    assert (df["sha"] == head).all(), (df["sha"].tolist(), head)       # this commit, clean tree
    assert (df["rollout_sha"] == head).all(), df["rollout_sha"].tolist()
    assert df.loc[df["arm"] == "bf16", "ratio_vs_bf16"].item() == 1.0
    assert (df["model"] == "tiny").all() and df["device"].str.startswith("cpu").all()
    md = (res / "throughput_table.md").read_text()
    assert "33,540" in md and "Beside the reference" in md             # the committed reference, labelled
    for ext, magic in (("png", b"\x89PNG"), ("pdf", b"%PDF")):
        assert (res / "figures" / f"throughput.{ext}").read_bytes()[:4] == magic
    print(f"fresh clone throughput_table: {elapsed:.0f} s")
    assert "Nothing to be done" in run("-n", "throughput_table").stdout  # and it is up to date after
    run("--report", "report.html", "throughput_table")                   # the HTML report, with the rst captions
    html = (clone / "report.html").read_text()
    assert "throughput.png" in html and "33,540 tokens/s on one B300 node" in html
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout
    assert status == "", status                                          # no tracked file touched, nothing new


def test_offline_run_install_stage_runs_its_function(tmp_path):
    """`tools/offline_run.sh install` runs the script's own install function under the stage's time cap (a
    program named `install` exists too: /usr/bin/install), with the Python given as PY."""
    shutil.copytree(REPO / "tools", tmp_path / "tools")
    (tmp_path / ".whl").mkdir()
    fake = tmp_path / "fakepy"
    fake.write_text('#!/usr/bin/env bash\necho "fakepy $*" >> "$(dirname "$0")/calls.log"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "tools/offline_run.sh", "install"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PY": str(fake), "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    assert "=== stage install rc=0" in (out / "stage.log").read_text()
    calls = (tmp_path / "calls.log").read_text()
    assert "-m pip install -q --no-deps --no-build-isolation -e ." in calls and "import torch" in calls
