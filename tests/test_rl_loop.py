"""End to end on `tiny` with the real engines: SFT cache, the GRPO loop, kill + resume == uninterrupted,
evals CSV, and the CLI jobs."""
import json

import pandas as pd
import pytest
import torch

from minite.engines.arms import load_arm
from minite.engines.models import load_model_config
from minite.rl import stability
from minite.rl.checkpoints import checkpoints
from minite.rl.config import load_rl_config
from minite.rl.spec import RunSpec
from minite.rl.stability import is_timing_key, run_stability
from minite.tasks import build_task

# small enough for seconds per step on 2 CPU cores
SMALL = {"sft.steps": 3, "sft.batch_size": 8, "sft.eval_prompts": 8, "rl.prompts_per_step": 2,
         "rl.group_size": 2, "rl.max_new_tokens": 4, "eval.k": 2, "eval.n_prompts": 3, "eval.max_new_tokens": 4,
         "drift.warmup": 3, "collapse.warmup": 3}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # these tiny ops are overhead-bound: one thread is as fast and does not spin-wait on a busy machine
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    cfg = load_rl_config("cpu", SMALL)
    task = build_task(cfg["task"], seed=0)
    model = load_model_config("tiny")
    from minite.rl.sft import run_sft
    sft_dir = tmp_path_factory.mktemp("sft")
    info = run_sft(model, cfg, task, sft_dir, progress=False)
    return cfg, task, model, sft_dir, info


class SimulatedKill(RuntimeError):
    """The process 'dies' after a step's JSONL line, before its checkpoint."""


def _kill_after(step: int):
    def hook(s: int) -> None:
        if s == step:
            raise SimulatedKill(f"simulated kill after step {s}")
    return hook


def _strip(line: dict) -> dict:
    return {k: v for k, v in line.items() if not is_timing_key(k)}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_cache_hit(setup, tmp_path):
    cfg, task, model, sft_dir, info = setup
    from minite.rl.sft import run_sft
    assert not info["cache_hit"] and (sft_dir / "weights" / "config.json").is_file()
    assert info["heldout_after"]["nll_per_token"] < info["heldout_before"]["nll_per_token"]
    mtime = (sft_dir / "sft.json").stat().st_mtime_ns
    again = run_sft(model, cfg, task, sft_dir, progress=False)
    assert again["cache_hit"] and again["config_hash"] == info["config_hash"]
    assert (sft_dir / "sft.json").stat().st_mtime_ns == mtime          # a no-op: nothing rewritten
    other = load_rl_config("cpu", {**SMALL, "sft.lr": 1e-3})
    from minite.rl.config import config_hash
    from minite.rl.sft import cached_sft, sft_key
    assert cached_sft(sft_dir, config_hash(sft_key(model, other, task, 0))) is None


@pytest.mark.parametrize("arm_name", ["naive_te_nvfp4"])
def test_kill_and_resume_gives_the_same_curve(setup, tmp_path, arm_name, monkeypatch):
    cfg, task, model, sft_dir, _ = setup
    arm = load_arm(arm_name)
    spec = RunSpec(arm, model, cfg, task, init=sft_dir)
    full = tmp_path / "full"
    s_full = run_stability(spec, full, 3, ckpt_every=2, progress=False)
    assert [s for s, _ in checkpoints(full)] == [2, 3]
    killed = tmp_path / "killed"
    with monkeypatch.context() as m, pytest.raises(SimulatedKill):
        m.setattr(stability, "_after_step", _kill_after(3))
        run_stability(spec, killed, 3, ckpt_every=2, progress=False)
    assert len(_lines(killed / "stability.jsonl")) == 3 and [s for s, _ in checkpoints(killed)] == [2]
    s_res = run_stability(spec, killed, 3, ckpt_every=2, progress=False)
    a, b = _lines(full / "stability.jsonl"), _lines(killed / "stability.jsonl")
    assert [line["step"] for line in b] == [1, 2, 3]
    assert [_strip(line) for line in a] == [_strip(line) for line in b]           # the same curve, bit for bit
    assert s_res["final_reward"] == s_full["final_reward"] and s_res["drift"] == s_full["drift"]
    line = a[-1]
    for key in ("reward_mean", "accuracy", "response_len_mean", "entropy_sampler_mc", "grad_norm", "k1", "k3",
                "chi2", "token_mult_prob_error", "max_abs_dp", "mean_abs_dp", "pearson_p", "frac_dlogp_gt_0.1",
                "generate_s", "score_s", "update_s", "sync_s", "generate_tokens_per_s", "wall_s", "cusum"):
        assert key in line, key
    assert line["k3"] > 0                                              # the naive arm's engines differ
    summ = json.loads((killed / "stability_summary.json").read_text())
    for key in ("alarm_step", "collapse_step", "lead_steps", "final_reward", "provenance"):
        assert key in summ
    # extending a finished run continues from its last checkpoint
    run_stability(spec, killed, 4, ckpt_every=2, progress=False)
    assert [line["step"] for line in _lines(killed / "stability.jsonl")] == [1, 2, 3, 4]
    segs = _lines(killed / "segments.jsonl")                          # kill, resume, extend: one line each
    assert [(g["resumed_from"], g["target_steps"]) for g in segs] == [(0, 3), (2, 3), (3, 4)]
    assert all(g["sha"] and g["device"] for g in segs)
    assert json.loads((killed / "stability_summary.json").read_text())["segments"] == segs
    # a different config in the same directory is refused instead of mixed into the curve
    with pytest.raises(RuntimeError, match="different run"):
        run_stability(RunSpec(arm, model, load_rl_config("cpu", {**SMALL, "rl.lr": 1e-3}), task, init=sft_dir),
                      killed, 5, progress=False)
    # evals from the same run: step 0 (warm start) and every checkpoint
    from minite.rl.evaluate import evaluate_run
    csv = tmp_path / "evals.csv"
    df = evaluate_run(RunSpec(arm, model, cfg, task), killed, csv, progress=False)
    assert list(df.columns) == ["arm", "step", "k", "mean_at_k", "pass_at_k", "n_prompts", "temperature", "sha",
                                "device", "date"]
    assert df["step"].tolist() == [0, 2, 3, 4] and (df["k"] == 2).all() and (df["n_prompts"] == 3).all()
    assert df["mean_at_k"].between(0, 1).all() and (df["pass_at_k"] >= df["mean_at_k"]).all()
    again = evaluate_run(RunSpec(arm, model, cfg, task), killed, tmp_path / "again.csv", steps=[2], progress=False)
    assert again["mean_at_k"].tolist() == df[df.step == 2]["mean_at_k"].tolist()      # reproducible
    assert pd.read_csv(csv)["arm"].unique().tolist() == [arm_name]


def test_cli_jobs_and_errors(setup, tmp_path, caplog):
    from minite.cli import main
    cfg, task, model, sft_dir, _ = setup
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["sft", "--model", "tiny", "--out", str(sft_dir), "--no-progress", *sets]) == 0
    assert "cache hit" in caplog.text
    caplog.clear()
    out = tmp_path / "run"
    assert main(["rl", "--arm", "bf16", "--model", "tiny", "--steps", "1", "--ckpt-every", "1", "--init",
                 str(sft_dir), "--out", str(out), "--no-progress", *sets]) == 0
    assert len(_lines(out / "stability.jsonl")) == 1 and (out / "stability_summary.json").is_file()
    assert main(["eval", "--arm", "bf16", "--model", "tiny", "--run", str(out), "--out", str(tmp_path / "e.csv"),
                 "--no-progress", *sets]) == 0
    assert pd.read_csv(tmp_path / "e.csv")["step"].tolist() == [0, 1]
    assert main(["rl", "--arm", "fp8", "--steps", "1", "--out", str(tmp_path / "x")]) == 2
    assert main(["rl", "--arm", "bf16", "--steps", "1", "--rl-config", "nope", "--out", str(tmp_path / "x")]) == 2
    assert main(["rl", "--arm", "bf16", "--steps", "1", "--init", str(tmp_path / "missing"), "--out",
                 str(tmp_path / "x"), *sets]) == 2
    assert main(["sft", "--set", "rl.bogus=1", "--out", str(tmp_path / "y")]) == 2
    # a directory that is no checkpoint: refused before the first write, and no empty run directory left
    (tmp_path / "not_a_ckpt").mkdir()
    assert main(["rl", "--arm", "bf16", "--steps", "1", "--checkpoint", str(tmp_path / "not_a_ckpt"), "--out",
                 str(tmp_path / "z"), *sets]) == 2
    assert not (tmp_path / "z").exists()
    # eval of a directory that holds no run: an error, not a fresh model's accuracy as step 0
    assert main(["eval", "--arm", "bf16", "--model", "tiny", "--run", str(tmp_path / "not_a_ckpt"), "--out",
                 str(tmp_path / "e2.csv"), "--no-progress", *sets]) == 2
    assert not (tmp_path / "e2.csv").exists()
    # ... unless a warm start is named: then its step 0 alone (the drift study's calibration)
    assert main(["eval", "--arm", "bf16", "--model", "tiny", "--checkpoint", str(sft_dir), "--run",
                 str(tmp_path / "calibration"), "--out", str(tmp_path / "e3.csv"), "--no-progress", *sets]) == 0
    assert pd.read_csv(tmp_path / "e3.csv")["step"].tolist() == [0]
    err = caplog.text
    assert "unknown arm" in err.lower() or "fp8" in err
    assert "not found" in err and "bogus" in err
    assert "not a local HF checkpoint" in err and "not a run directory" in err


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(setup, tmp_path, paced_minite):
    """A real kill -9 of the job process between steps: rerunning the same command finishes the run with
    at most the step in flight recomputed, and the same curve as an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg, task, model, sft_dir, _ = setup
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]

    def cmd(out):
        return [sys.executable, paced_minite, "rl", "--arm", "bf16", "--model", "tiny", "--steps", "4",
                "--ckpt-every", "1", "--init", str(sft_dir), "--out", str(out), "--no-progress", *sets]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full"
    subprocess.run(cmd(full), check=True, env=env, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    jsonl = killed / "stability.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not jsonl.exists() or len(jsonl.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / ".lock").exists()                     # left behind by the dead process
    subprocess.run(cmd(killed), check=True, env=env, capture_output=True)
    a, b = _lines(full / "stability.jsonl"), _lines(jsonl)
    assert [line["step"] for line in b] == [1, 2, 3, 4]
    assert [_strip(line) for line in a] == [_strip(line) for line in b]


def test_kl_reference_and_tis_options(setup, tmp_path):
    cfg, task, model, sft_dir, _ = setup
    opt = load_rl_config("cpu", {**SMALL, "rl.beta": 0.05, "rl.tis_cap": 2.0, "rl.micro_batch_size": 2})
    run_stability(RunSpec(load_arm("naive_te_nvfp4"), model, opt, task, init=sft_dir), tmp_path / "r", 1,
                  progress=False)
    line = _lines(tmp_path / "r" / "stability.jsonl")[0]
    assert 0 < line["tis_weight_mean"] <= 2.0 and 0 <= line["tis_frac_capped"] <= 1
    assert line["grad_norm"] >= 0 and line["n_response_tokens"] > 0


def test_micro_batching_gives_the_full_batch_token_mean(setup):
    """GRPO's token-mean must not depend on how the trainer slices the batch (unequal response lengths)."""
    from minite.engines.trainer import Trainer
    from minite.rl.grpo import make_loss_fn
    from minite.rl.spec import init_weights_path
    _, _, model, sft_dir, _ = setup
    ids = torch.tensor([[1, 4, 13, 5, 15, 2, 0, 0], [1, 5, 13, 6, 15, 7, 8, 2],
                        [1, 6, 13, 7, 15, 9, 2, 0], [1, 7, 13, 8, 15, 4, 5, 6]])
    resp = torch.tensor([[0, 0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1],
                         [0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1]])
    att = (ids != 0).long()
    out = []
    for mbs in (None, 1):
        tr = Trainer("bf16", model, checkpoint=str(init_weights_path(sft_dir)), micro_batch_size=mbs, lr=1e-3)
        old = tr.logprobs(ids, att)
        batch = {"input_ids": ids, "attention_mask": att, "loss_mask": resp, "old_logprobs": old,
                 "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]), "sampler_logprobs": old}
        out.append(tr.update(batch, loss_fn=make_loss_fn()))
    assert out[0]["loss"] == pytest.approx(out[1]["loss"], abs=1e-6)
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=2e-2)   # bf16 compute per slice
