"""The drift study: its model, the results table and study figure on synthetic runs, dry-runs of the drift
profile (placement on two GPUs, the second BF16 seed, the stress overlay) and of results_table on the cpu
profile, and (slow) a real CPU run of results_table, an extra seed included, on the cpu profile at toy size."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from test_pipeline import dry, job_counts, smk, wf  # noqa: F401  (the workflow-copy fixture)

from minite.engines.models import count_params, load_model_config
from minite.provenance import append_jsonl, write_json
from minite.report import figures, load
from minite.report.results_table import COLUMNS, results_table, write_results_table

RUNS = ["bf16", "bf16_seed1", "naive_te_nvfp4", "minite_nvfp4"]


def test_study_model_is_a_many_expert_moe_under_half_a_billion():
    cfg = load_model_config("moe64")
    n = count_params(cfg)
    assert n["total"] <= 0.5e9 and cfg["num_experts"] == 64 and cfg["num_experts_per_tok"] == 8
    assert cfg["max_position_embeddings"] >= 11 + 1024               # prompt + the stress setting's responses


def _run(r, run, *, k3, heldout, summary=True, collapse_at=None, watch_alarm=None, steps=40, in_run=True):
    arm = load.parse_run(run)[0]
    for step in range(1, steps + 1):
        rec = {"arm": arm, "step": step, "reward_mean": 0.5, "k3": k3(step), "max_abs_dp": 0.1, "grad_norm": 1.0,
               "router_disagree": 0.0, "step_s": 2.0, "alarm": False, "collapsed": bool(collapse_at and
                                                                                          step >= collapse_at)}
        rec["watch"] = {"grad_norm": {"cusum": 0.0, "alarm": bool(watch_alarm and step >= watch_alarm)}}
        if in_run and (step - 1) % 10 == 0:
            rec.update(heldout_mean_at_k=heldout[(step - 1) // 10], heldout_updates=step - 1)
        append_jsonl(r / run / "stability.jsonl", rec)
    if not in_run:
        pd.DataFrame({"arm": arm, "step": [0, 20, 40], "mean_at_k": heldout[:3]}).to_csv(r / run / "evals.csv",
                                                                                         index=False)
    if summary:
        write_json(r / run / "stability_summary.json", {
            "arm": arm, "drift_metric": "k3", "alarm_step": 25 if arm == "naive_te_nvfp4" else None,
            "collapse_step": collapse_at, "alarms": {"k3": None, "grad_norm": watch_alarm},
            "provenance": {"sha": "abc123", "device": "NVIDIA H200", "date": "2026-12-01", "command": "rl"}})


@pytest.fixture
def results(tmp_path):
    r = tmp_path / "results" / "drift"
    _run(r, "bf16", k3=lambda s: 1e-4, heldout=[0.40, 0.50, 0.55, 0.60])
    _run(r, "bf16_seed1", k3=lambda s: 2e-4, heldout=[0.40, 0.46, 0.58, 0.50], summary=False, steps=30)
    _run(r, "naive_te_nvfp4", k3=lambda s: 1e-3 * s, heldout=[0.40, 0.45, 0.30, 0.10], collapse_at=32,
         watch_alarm=20)
    _run(r, "minite_nvfp4", k3=lambda s: 0.0, heldout=[0.40, 0.50, 0.70], in_run=False)
    return r


def test_results_table_pools_seeds_and_reads_every_source(results):
    df, records = results_table(results, RUNS)
    assert list(df.columns) == COLUMNS and list(df["arm"]) == ["bf16", "naive_te_nvfp4", "minite_nvfp4"]
    t = df.set_index("arm")
    b = t.loc["bf16"]
    assert b.seeds == "0;1" and b.steps == 30                           # the unfinished seed: its 30 steps
    assert b.heldout_start == pytest.approx(0.40) and b.heldout_start_spread == 0.0
    assert b.heldout_best == pytest.approx((0.60 + 0.58) / 2) and b.heldout_best_spread == pytest.approx(0.02)
    assert b.heldout_end == pytest.approx((0.60 + 0.58) / 2)           # bf16_seed1's last eval is at 20 updates
    assert b.k3_median == pytest.approx(1.5e-4) and b.k3_max == pytest.approx(2e-4)
    assert b.collapse_step == "none;none" and b.alarm_step == "none;none" and b.step_s == 2.0
    n = t.loc["naive_te_nvfp4"]
    assert n.collapse_step == "32" and n.alarm_step == "25" and n.first_watch_alarm == "grad_norm@20"
    assert n.k3_max == pytest.approx(0.04) and n.heldout_end == pytest.approx(0.10)
    m = t.loc["minite_nvfp4"]                                           # held-out from evals.csv (eval job)
    assert m.heldout_start == pytest.approx(0.4) and m.heldout_best == pytest.approx(0.7) and m.k3_max == 0.0
    assert records["bf16"]["sha"] == "abc123"


def test_results_table_of_an_unfinished_run_uses_its_step_flags(results):
    (results / "naive_te_nvfp4" / "stability_summary.json").unlink()
    t = results_table(results, ["naive_te_nvfp4"])[0].set_index("arm").loc["naive_te_nvfp4"]
    assert t.collapse_step == "32" and t.alarm_step == "none" and t.first_watch_alarm == "grad_norm@20"


def test_results_table_files_and_errors(results):
    write_results_table(results, RUNS, profile="drift")
    csv = pd.read_csv(results / "results_table.csv")
    assert len(csv) == 3 and csv.loc[0, "seeds"] == "0;1"
    md = (results / "results_table.md").read_text()
    assert "| bf16 | 0;1 | 30 | 0.400 | 0.590 ± 0.010 |" in md and "## Provenance" in md and "NVIDIA H200" in md
    assert "\\begin{tabular}" in (results / "results_table.tex").read_text()
    with pytest.raises(FileNotFoundError, match="stability.jsonl"):
        results_table(results, ["naive_te_nvfp4_tis"])
    (results / "bf16" / "stability.jsonl").write_text(
        json.dumps({"arm": "minite_nvfp4", "step": 1, "k3": 0.0}) + "\n")
    with pytest.raises(load.ResultError, match="expected only 'bf16'"):
        results_table(results, ["bf16"])


def test_study_figure_has_six_panels_and_seed_bands(results, tmp_path):
    stab = load.load_stability(results, RUNS)
    held = load.load_heldout(results, RUNS)
    assert set(held["source"]) == {"in-run", "evals.csv"} and set(held["seed"]) == {0, 1}
    with pytest.warns(UserWarning, match="bf16_seed1"):              # the unfinished run has no summary yet
        summaries = load.load_stability_summary(results, RUNS, missing="skip")
    fig = figures.drift_study(stab, held, None, smooth=5, summaries=summaries)
    axes = fig.axes
    assert len(axes) == 6 and axes[0].get_yscale() == "log" and axes[4].get_yscale() == "linear"
    assert any(c.__class__.__name__ == "FillBetweenPolyCollection" or "Poly" in c.__class__.__name__
               for c in axes[0].collections)                           # the BF16 seed band
    assert "miniTE NVFP4 (= 0" in " ".join(t.get_text() for t in axes[0].get_legend().get_texts())
    figures.drift_study(stab, held, tmp_path / "study")
    assert (tmp_path / "study.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "study.pdf").exists()


# ------------------------------------------------------------------------------------------ the pipeline
def test_dry_run_drift_profile_places_runs_and_seeds(wf):  # noqa: F811
    r = smk(wf, "-n", "-p", "drift_study", "--profile", "workflow/profiles/drift")
    jobs = job_counts(r.stdout)
    assert jobs == {"sft": 1, "rl": 4, "rl_seed": 1, "results_table_files": 1, "figure_drift_study": 1,
                    "figure_drift": 1, "drift_study": 1}                 # held-out in run: no eval jobs
    cmds = {ln.split("--arm ")[1].split()[0] + (" seed1" if "--seed 1" in ln else ""): ln
            for ln in r.stdout.splitlines() if "minite rl --arm" in ln}
    where = {run: next(d for d in ("cuda:0", "cuda:1") if f"--device {d}" in c) for run, c in cmds.items()}
    assert where == {"bf16": "cuda:0", "naive_te_nvfp4": "cuda:1", "naive_te_nvfp4_tis": "cuda:0",
                     "minite_nvfp4": "cuda:1", "bf16 seed1": "cuda:0"}
    assert "--out results/drift/bf16_seed1" in cmds["bf16 seed1"] and "--steps 1000" in cmds["bf16"]
    assert "--model moe64 --rl-config drift" in cmds["bf16"]
    assert "results-table --results results/drift --arms bf16 naive_te_nvfp4 naive_te_nvfp4_tis minite_nvfp4 " \
           "bf16_seed1" in r.stdout
    stress = smk(wf, "-n", "-p", "drift_study", "--profile", "workflow/profiles/drift", "--configfile",
                 "workflow/profiles/drift/stress.yaml").stdout
    rl = next(ln for ln in stress.splitlines() if "minite rl --arm naive_te_nvfp4 " in ln)
    assert "--out results/drift_stress/naive_te_nvfp4" in rl and "--set rl.lr=4e-05" in rl
    assert "--set task.digits_b=8" in rl and "--set rl.max_new_tokens=1024" in rl
    assert "--set task.digits_b=8" in next(ln for ln in stress.splitlines() if "minite sft" in ln)


def test_dry_run_results_table_cpu_profile(wf):  # noqa: F811
    assert dry(wf, "results_table", "--config", "extra_seeds={bf16: [1]}") == {
        "sft": 1, "rl": 3, "rl_seed": 1, "eval": 3, "eval_seed": 1, "results_table_files": 1, "results_table": 1}
    r = smk(wf, "-n", "-p", "results_table", "--config", "extra_seeds={bf16: [1]}")
    ev = next(ln for ln in r.stdout.splitlines() if "minite eval --arm bf16" in ln and "seed" in ln)
    assert "--device cpu" in ev and "--seed 1 --run-dir results/cpu/bf16_seed1" in ev   # no placement on CPU
    bad = smk(wf, "-n", "results_table", "--config", "extra_seeds={fp8: [1]}", check=False)
    assert bad.returncode != 0 and "extra_seeds names arms" in bad.stdout + bad.stderr


TOY = """jobs:
  sft:
    args: {set: {sft.steps: 3, sft.batch_size: 8, sft.eval_prompts: 8}}
  rl:
    args: {steps: 3, ckpt-every: 3, set: {sft.steps: 3, sft.batch_size: 8, sft.eval_prompts: 8,
           rl.prompts_per_step: 2, rl.group_size: 2, rl.max_new_tokens: 4, drift.warmup: 3, collapse.warmup: 3}}
  eval:
    args: {set: {sft.steps: 3, sft.batch_size: 8, sft.eval_prompts: 8, eval.k: 2, eval.n_prompts: 3,
           eval.max_new_tokens: 4}}
extra_seeds: {bf16: [1]}
"""


@pytest.mark.slow
def test_results_table_end_to_end_cpu(wf):  # noqa: F811
    """`snakemake results_table` for real on the cpu profile at toy size: SFT, three arms and a second BF16 seed,
    their evals, the table; then the study figure from the same runs."""
    (wf / "toy.yaml").write_text(TOY)
    smk(wf, "--cores", "2", "results_table", "--configfile", "toy.yaml")
    r = wf / "results" / "cpu"
    df = pd.read_csv(r / "results_table.csv")
    assert list(df["arm"]) == ["bf16", "naive_te_nvfp4", "minite_nvfp4"] and list(df["seeds"]) == ["0;1", "0", "0"]
    assert (df["steps"] == 3).all() and df["heldout_start"].between(0, 1).all() and (df["step_s"] > 0).all()
    assert df.loc[df.arm == "minite_nvfp4", "k3_max"].item() == 0.0 and df.loc[df.arm == "naive_te_nvfp4",
                                                                                "k3_median"].item() > 0
    assert df["device"].str.startswith("cpu").all()
    assert "| run | sha | device | date | command |" in (r / "results_table.md").read_text()
    assert json.loads((r / "bf16_seed1" / "run.json").read_text())["seed"] == 1
    smk(wf, "--cores", "2", "figure_drift_study", "--configfile", "toy.yaml")
    assert (r / "figures" / "drift_study.png").read_bytes()[:4] == b"\x89PNG"
    assert "Nothing to be done" in smk(wf, "-n", "results_table", "--configfile", "toy.yaml").stdout


def test_drift_rl_config_end_to_end_on_tiny(tmp_path, caplog):
    """The drift profile's RL config, shrunk to toy size on `tiny` (2 x 2-digit products: ~100-token answers):
    SFT on gold traces, then the TIS arm's GRPO steps with every drift metric, through the job commands."""
    import logging

    from minite.cli import main
    caplog.set_level(logging.INFO)
    toy = {"task.digits": 2, "task.digits_b": 2, "sft.steps": 2, "sft.batch_size": 4, "sft.eval_prompts": 4,
           "sft.micro_batch_size": None, "rl.prompts_per_step": 2, "rl.group_size": 2, "rl.max_new_tokens": 112,
           "rl.micro_batch_size": None, "eval.k": 2, "eval.n_prompts": 2, "eval.max_new_tokens": 112,
           "metrics.heldout_every": 1, "metrics.router_sequences": 2, "drift.warmup": 3, "collapse.warmup": 3}
    sets = [x for k, v in toy.items() for x in ("--set", f"{k}={'null' if v is None else v}")]
    common = ["--model", "tiny", "--rl-config", "drift", "--device", "cpu", "--no-progress", *sets]
    assert main(["sft", "--out", str(tmp_path / "sft"), *common]) == 0
    sft = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert sft["task"]["kind"] == "long_arithmetic" and sft["steps"] == 2
    out = tmp_path / "naive_te_nvfp4_tis"
    assert main(["rl", "--arm", "naive_te_nvfp4_tis", "--steps", "2", "--checkpoint", str(tmp_path / "sft"),
                 "--out", str(out), *common]) == 0
    lines = [json.loads(x) for x in (out / "stability.jsonl").read_text().splitlines()]
    assert [r["heldout_updates"] for r in lines] == [0, 1] and all("router_disagree" in r for r in lines)
    assert all(r["response_len_max"] <= 112 and 0 < r["tis_weight_mean"] <= 2 for r in lines)
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["rl"]["tis_cap"] == 2.0 and run["task"]["digits"] == 2
    write_results_table(tmp_path, ["naive_te_nvfp4_tis"])
    assert pd.read_csv(tmp_path / "results_table.csv")["steps"].tolist() == [2]


@pytest.mark.gpu
def test_rl_on_the_second_gpu_keeps_the_aligned_arm_exact(tmp_path):
    """--device cuda:1 (the drift profile's placement): kernels, CUDA graphs and generators on GPU 1; the aligned
    arm's mismatch and router disagreement stay exactly 0 there."""
    import torch

    from minite.cli import main
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    sets = [x for k, v in {"sft.steps": 2, "sft.batch_size": 8, "rl.prompts_per_step": 2, "rl.group_size": 2,
                           "rl.max_new_tokens": 8, "drift.warmup": 3, "collapse.warmup": 3}.items()
            for x in ("--set", f"{k}={v}")]
    common = ["--model", "tiny", "--device", "cuda:1", "--no-progress", *sets]
    assert main(["sft", "--out", str(tmp_path / "sft"), *common]) == 0
    assert main(["rl", "--arm", "minite_nvfp4", "--steps", "2", "--checkpoint", str(tmp_path / "sft"), "--out",
                 str(tmp_path / "run"), *common]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "stability.jsonl").read_text().splitlines()]
    assert all(r["k3"] == 0.0 and r["router_disagree"] == 0.0 for r in lines)
