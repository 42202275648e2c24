"""SFT warm start: supervised training of the bf16 trainer on task examples, cached, shared by every arm.

Why: a tiny/small model from random init has zero reward on the task, so GRPO (group-normalised
advantages) gets no signal. A short teacher-forced run on (prompt, answer + EOS) gives every arm the same
non-trivial starting policy. The bf16 arm's trainer does it (the reference numerics); the result is saved as
a local Hugging Face checkpoint (``<out>/weights/``: config.json + safetensors, BF16) that every arm's
trainer loads with ``Trainer(..., checkpoint=...)``.

Cache: ``<out>/sft.json`` holds the config hash (model, task, SFT hyper-parameters, seed) with the accuracy
reached and provenance; a second call with the same hash and the weights present is a no-op. Writes are
atomic: weights go to a temporary directory renamed into place, ``sft.json`` last.

Accuracy without sampling: for a held-out prompt the probability that a temperature-1 sample is exactly
``answer + EOS`` is exp(sum of the trainer's log-probs of those tokens); its mean over the held-out set is
the exact expected accuracy (mean@1 at temperature 1, top_p 1) under the trainer. We also report
``greedy_certain``: the fraction of prompts where every answer token has probability > 0.5 (then greedy
decoding provably returns the answer).

Under torchrun the bf16 trainer is sharded (FSDP2): each rank trains on its rows of every batch (the batch
size must split evenly), every rank scores the whole held-out set, and rank 0 writes the weights and sft.json.
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minite import distributed as D
from minite.engines.models import check_positions
from minite.provenance import provenance, read_json, write_json
from minite.rl.config import config_hash
from minite.rl.data_parallel import local_rows
from minite.tasks import sft_batch


def sft_key(model_cfg: dict, cfg: dict, task, seed: int) -> dict:
    return {"model": model_cfg, "sft": cfg["sft"], "task": task.config(), "seed": seed, "arm": "bf16",
            "version": 1}


def cached_sft(out_dir, key_hash: str) -> dict | None:
    meta = Path(out_dir) / "sft.json"
    if not meta.is_file():
        return None
    info = read_json(meta, "delete it (or pass --force) to retrain the warm start")
    if info.get("config_hash") == key_hash and (info.get("weights") is None
                                                or (Path(out_dir) / "weights" / "config.json").is_file()):
        return info
    return None


def run_sft(model_cfg: dict, cfg: dict, task, out_dir, *, seed: int = 0, device: str = "cpu",
            progress: bool = True, force: bool = False) -> dict:
    """Train (or reuse) the warm start; returns the sft.json dict."""
    from minite.engines.trainer import Trainer

    out = Path(out_dir)
    key = sft_key(model_cfg, cfg, task, seed)
    h = config_hash(key)
    if not force and (hit := cached_sft(out, h)) is not None:
        return {**hit, "cache_hit": True}
    s = cfg["sft"]
    heldout = task.heldout(s["eval_prompts"])
    check_sft_width(model_cfg, sft_batch(task, heldout))   # before the trainer is built; each batch again below
    t0 = time.perf_counter()
    # CPUs without bf16 GEMMs run the bf16 model ~3x slower than fp32; the warm start is shared by all arms
    # (not part of the comparison), so on CPU it computes in fp32. The masters are fp32 anyway; the saved
    # weights are loaded as BF16 by every arm's trainer.
    dtype = compute_dtype(s.get("compute_dtype", "auto"), device)
    trainer = Trainer("bf16", model_cfg, device=device, seed=seed, lr=s["lr"],
                      micro_batch_size=s["micro_batch_size"], compute_dtype=dtype)
    before = evaluate_teacher_forced(trainer, task, heldout)
    losses = []
    n = int(s["steps"])
    bar = tqdm(range(n), desc="sft", disable=not progress, unit="step")
    for step in bar:
        # cosine decay to 10% of lr: a short run at a high lr needs the anneal to settle (linear warm-up 5%)
        trainer.set_lr(s["lr"] * _lr_factor(step, n))
        batch = sft_batch(task, task.train_batch(step, s["batch_size"], stream="sft"))
        check_sft_width(model_cfg, batch)
        stats = trainer.update(local_rows(batch, s["batch_size"]))
        losses.append(float(stats["loss"]))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"SFT diverged at step {step}: loss {losses[-1]}")
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    after = evaluate_teacher_forced(trainer, task, heldout)

    weights = None
    main = D.is_main()
    out.mkdir(parents=True, exist_ok=True)      # only now: a run refused above leaves no directory
    if n > 0 or model_cfg.get("checkpoint") is None:
        tmp = out / ".weights.tmp"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        trainer.save_pretrained(tmp)        # sharded: every rank gathers, rank 0 writes
        if main:
            shutil.rmtree(out / "weights", ignore_errors=True)
            tmp.rename(out / "weights")
        weights = "weights"
    info = {"config_hash": h, "weights": weights, "compute_dtype": dtype, "model": model_cfg.get("name"),
            "task": task.config(), "sft": s, "seed": seed, "steps": n, "final_loss": losses[-1] if losses else None,
            "loss_first10": sum(losses[:10]) / max(len(losses[:10]), 1) if losses else None,
            "loss_last10": sum(losses[-10:]) / max(len(losses[-10:]), 1) if losses else None,
            "heldout_before": before, "heldout_after": after, "seconds": time.perf_counter() - t0,
            "definitions": {"expected_acc": "mean over held-out prompts of p(answer+EOS | prompt) under the "
                                            "trainer = exact mean@1 at temperature 1",
                            "greedy_certain": "fraction of held-out prompts whose every answer token has p > 0.5"},
            "provenance": provenance(device)}
    if main:
        write_json(out / "sft.json", info)
    D.barrier()
    return {**info, "cache_hit": False}


def check_sft_width(model_cfg: dict, batch: dict) -> None:
    """An SFT batch (prompt + answer + EOS) must fit the model's positions; a task's answer length has no
    config key of its own (long_arithmetic's scratchpad grows with task.digits)."""
    check_positions(model_cfg, batch["input_ids"].shape[1], "the SFT sequence width (prompt + answer + EOS of "
                                                            "the task's problems, task.* config)")


def compute_dtype(choice: str, device: str) -> str:
    if choice == "auto":
        return "float32" if str(device).startswith("cpu") else "bfloat16"
    if choice not in ("float32", "bfloat16"):
        raise ValueError(f"sft.compute_dtype must be auto | float32 | bfloat16, got {choice!r}")
    return choice


def _lr_factor(i: int, n: int) -> float:
    warm = max(1, n // 20)
    if i < warm:
        return (i + 1) / warm
    frac = (i - warm) / max(1, n - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


@torch.no_grad()
def evaluate_teacher_forced(trainer, task, problems) -> dict:
    """Expected temperature-1 accuracy and greedy-certain fraction on ``problems`` (see module docstring)."""
    b = sft_batch(task, problems)
    lp = trainer.logprobs(b["input_ids"], b["attention_mask"]).float().cpu()
    m = b["loss_mask"][:, 1:].bool()
    seq = (lp * m).sum(1)
    certain = ((lp > math.log(0.5)) | ~m).all(1)
    return {"expected_acc": float(seq.exp().mean()), "greedy_certain": float(certain.float().mean()),
            "nll_per_token": float(-(lp[m]).mean()), "n_prompts": len(problems)}
