"""``python -m minite sft`` and ``rl`` under torchrun (two gloo processes on CPU): a kill -9 of the launcher
mid-run, then the same command again, resumes and gives the curve of an uninterrupted run; the aligned arm stays
bitwise aligned (k3 = 0) on every step, so every rank's sampler replica got exactly the trainer's weights."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minite.rl.stability import is_timing_key

pytestmark = pytest.mark.slow

# 1-digit sums: 60 SFT steps (~15 s) give rewards that are neither all 0 nor all 1, so GRPO updates something
SETS = {"task.digits": 1, "sft.steps": 60, "sft.batch_size": 32, "sft.eval_prompts": 8, "rl.prompts_per_step": 4,
        "rl.group_size": 4, "rl.max_new_tokens": 4, "drift.warmup": 3, "collapse.warmup": 3}
ARGS = [x for k, v in SETS.items() for x in ("--set", f"{k}={v}")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """The warm start, itself trained on two processes (rank 0 writes the gathered weights and sft.json)."""
    out = tmp_path_factory.mktemp("sft")
    done = subprocess.run([*TORCHRUN, "-m", "minite", "sft", "--model", "tiny", "--out", str(out), "--no-progress",
                           *ARGS], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((out / "sft.json").read_text())
    assert info["heldout_after"]["expected_acc"] > info["heldout_before"]["expected_acc"]
    assert (out / "weights" / "model.safetensors").is_file() and not (out / ".weights.tmp").exists()
    return out


def _torchrun(out, sft_dir, runner, steps=3):
    return [*TORCHRUN, runner, "rl", "--arm", "minite_nvfp4", "--model", "tiny", "--steps", str(steps),
            "--ckpt-every", "1", "--init", str(sft_dir), "--out", str(out), "--no-progress", *ARGS]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_torchrun_rl_killed_and_rerun_gives_the_same_curve(sft_dir, tmp_path, paced_minite):
    full = tmp_path / "full"
    done = subprocess.run(_torchrun(full, sft_dir, paced_minite), env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = tmp_path / "killed"
    launcher = subprocess.Popen(_torchrun(killed, sft_dir, paced_minite), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    jsonl = killed / "stability.jsonl"
    first = killed / "ckpt" / "step_000001" / "loop_state.json"
    deadline = time.time() + 300
    while time.time() < deadline and not first.exists():     # mid-run: after the first checkpoint
        time.sleep(0.1)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    rank0 = int((killed / ".lock").read_text())          # the writer, left behind by the dead run
    assert _gone(rank0), "a worker outlived its launcher"
    steps_before = len(_lines(jsonl))
    assert steps_before < 3
    again = subprocess.run(_torchrun(killed, sft_dir, paced_minite), env=ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]

    a, b = _lines(full / "stability.jsonl"), _lines(jsonl)
    assert [line["step"] for line in b] == [1, 2, 3]
    strip = [{k: v for k, v in line.items() if not is_timing_key(k)} for line in a]
    assert strip == [{k: v for k, v in line.items() if not is_timing_key(k)} for line in b]
    assert all(line["k3"] == 0 for line in a)                     # every replica holds the trainer's codes
    assert any(line["grad_norm"] > 0 for line in a)               # the learner did learn something
    assert all(line["sync_gather_bytes"] < line["sync_bytes"] * 1.01 for line in a)
    segs = _lines(killed / "segments.jsonl")
    assert segs[0]["resumed_from"] == 0 and segs[1]["resumed_from"] >= 1 and segs[1]["world_size"] == 2
    run = json.loads((killed / "run.json").read_text())
    assert run["provenance"]["world_size"] == 2
    summary = json.loads((killed / "stability_summary.json").read_text())
    assert summary["final_reward"] == json.loads((full / "stability_summary.json").read_text())["final_reward"]
    ckpt = killed / "ckpt" / "step_000003" / "trainer"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file()       # each rank's shards (DCP)
