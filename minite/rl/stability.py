"""The long-horizon GRPO stability run: one arm, N steps, checkpoints every k, resumable, drift alarm.

One step (docs/ENGINES.md):
  1. generate  the sampler draws a group of G responses per prompt, with its own log-probs
  2. reward    exact answer check (``task.reward``)
  3. score     the trainer recomputes the sampled tokens' log-probs (``trainer.logprobs``): these are the
               PPO "old" log-probs (no importance-sampling correction unless ``rl.tis_cap`` is set), and
               against the sampler's they give the mismatch metrics (``minite.diagnostics.metrics``)
  4. update    ``trainer.update(batch, loss_fn=grpo_loss)`` (one learner update per step)
  5. sync      ``sync_weights(trainer, sampler)``
and one JSONL line per step (``stability.jsonl``; keys ending in ``_s`` / ``_per_s`` are timings, everything
else is a deterministic function of the seed). Phases: ``generate_s`` = sampling + reward checking,
``score_s`` = the trainer's log-prob recompute, ``update_s`` = the learner update, ``sync_s`` = the weight
sync (``sync_bytes`` shipped); ``*_tokens_per_s`` = response tokens (generate) or all tokens (score, update)
per second. Entropy is the SAMPLER-side Monte-Carlo estimate: minus the
mean log-prob of the sampled response tokens under the distribution they were sampled from.

Determinism and resume: the prompts of step s are a pure function of (seed, s); sampling draws from one
``torch.Generator`` whose state is checkpointed; ``trainer.save`` holds model + optimizer + RNG. A checkpoint
``ckpt/step_XXXXXX/`` = trainer state + ``loop_state.json`` (step, data position, generator state, drift
alarm and collapse detector states, accumulated wall time), written to a temporary directory and renamed
into place, so a kill never leaves a half checkpoint. On restart the run resumes from the newest complete
checkpoint, drops the JSONL lines after it and recomputes them: with ``ckpt.every = 1`` at most the step in
flight is lost, and the curve is the same as an uninterrupted run's. Every invocation appends one line to
``segments.jsonl`` (the step it resumed from, the target, its provenance).
"""
from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minite.diagnostics.metrics import align_trainer_logprobs, mismatch_metrics
from minite.provenance import append_jsonl, provenance, write_json, write_text
from minite.rl.common import build_rl_engines, rollout, sequence_accuracy
from minite.rl.config import config_hash
from minite.rl.drift import CollapseDetector, DriftAlarm, lead_steps
from minite.rl.grpo import group_advantages, make_loss_fn, tis_weights

CKPT_PREFIX = "step_"


def is_timing_key(k: str) -> bool:
    return k.endswith("_s") or k.endswith("_per_s")


class SimulatedKill(RuntimeError):
    """Raised by ``crash_after_step`` (tests): the process 'dies' after a step's JSONL line, before its
    checkpoint."""


def run_stability(arm, model_cfg: dict, cfg: dict, task, out_dir, *, steps: int, init=None, seed: int = 0,
                  device: str = "cpu", ckpt_every: int | None = None, crash_after_step: int | None = None,
                  progress: bool = True) -> dict:
    """Run (or resume) ``steps`` GRPO steps of ``arm``; returns the summary dict (also written to disk)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _single_writer(out):
        return _run(arm, model_cfg, cfg, task, out, steps=steps, init=init, seed=seed, device=device,
                    ckpt_every=ckpt_every, crash_after_step=crash_after_step, progress=progress)


@contextlib.contextmanager
def _single_writer(out: Path):
    """One process per run directory (stability.jsonl has one writer): an O_EXCL lock file holding the pid;
    a lock left by a dead process (a kill) is taken over."""
    lock = out / ".lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)      # stale: its process is gone
                continue
            except PermissionError:
                pass
            raise RuntimeError(f"{out} is being written by another process (pid {pid}); one writer per run")
    else:
        raise RuntimeError(f"could not take the lock {lock}")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def _run(arm, model_cfg, cfg, task, out, *, steps, init, seed, device, ckpt_every, crash_after_step,
         progress) -> dict:
    rl, every = cfg["rl"], int(ckpt_every or cfg["ckpt"]["every"])
    if rl["temperature"] != 1.0:
        raise ValueError("rl.temperature must be 1.0: the trainer scores at temperature 1, so the mismatch "
                         "metrics and PPO ratios would compare different distributions")
    G, P = int(rl["group_size"]), int(rl["prompts_per_step"])
    run_id = config_hash({"arm": arm.raw or arm.name, "model": model_cfg, "cfg": {k: v for k, v in cfg.items()
                          if k not in ("ckpt", "eval", "_source")}, "task": task.config(), "seed": seed,
                          "init": str(init) if init else None})
    _check_run_id(out, run_id)

    calib = [task.encode_prompt(p) for p in task.train_batch(0, P * G, stream="calib")]  # fixed calibration batch
    trainer, sampler, sync = build_rl_engines(
        arm, model_cfg, device=device, seed=seed, lr=rl["lr"], micro_batch_size=rl["micro_batch_size"],
        init=init, max_batch=P * G, max_seq_len=task.max_prompt_len + rl["max_new_tokens"], calib_prompts=calib)
    loss_fn = make_loss_fn(rl["clip_low"], rl["clip_high"], rl["beta"], rl["tis_cap"], rl["agg"])
    reference = _reference(arm, model_cfg, device, seed, init) if rl["beta"] else None

    gen = torch.Generator(device=device).manual_seed(seed)
    alarm, collapse = DriftAlarm(**cfg["drift"]), CollapseDetector(**cfg["collapse"])
    jsonl = out / "stability.jsonl"
    start, wall0 = 0, 0.0
    ck = latest_checkpoint(out)
    if ck is not None:
        state = json.loads((ck / "loop_state.json").read_text())
        trainer.load(str(ck / "trainer"))
        sync(trainer, sampler)
        gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state["generator"])), dtype=torch.uint8))
        alarm.load_state_dict(state["drift"])
        collapse.load_state_dict(state["collapse"])
        start, wall0 = int(state["step"]), float(state["wall_s"])
    _truncate_jsonl(jsonl, start)
    prov = provenance(device)
    write_json(out / "run.json", {"run_id": run_id, "arm": arm.name, "model": model_cfg.get("name"),
                                  "init": str(init) if init else None, "seed": seed, "config": cfg,
                                  "task": task.config(), "resumed_from": start, "provenance": prov})
    # run.json describes the latest invocation only; segments.jsonl keeps every one (a long run done in
    # several jobs, each possibly from another commit) -- a scheduler may clear the job's log between them.
    append_jsonl(out / "segments.jsonl", {"resumed_from": start, "target_steps": steps, "run_id": run_id, **prov})
    if start and progress:
        tqdm.write(f"rl {arm.name}: resuming from checkpoint step {start} (wall {wall0:.1f} s so far)")

    t_run = time.perf_counter()
    bar = tqdm(range(start + 1, steps + 1), desc=f"rl {arm.name}", disable=not progress, initial=start,
               total=steps, unit="step")
    for step in bar:
        rec = _one_step(step, task, trainer, sampler, sync, loss_fn, reference, rl, gen, P, G)
        rec.update(alarm.update(step, rec[rl["drift_metric"]]))
        rec.update(collapse.update(step, rec["reward_mean"]))
        rec["wall_s"] = wall0 + time.perf_counter() - t_run
        append_jsonl(jsonl, {"arm": arm.name, **rec})
        bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", k3=f"{rec['k3']:.2e}")
        if crash_after_step is not None and step == crash_after_step:
            raise SimulatedKill(f"simulated kill after step {step}")
        if step % every == 0 or step == steps:
            save_checkpoint(out, step, trainer, gen, alarm, collapse, rec["wall_s"], cfg["ckpt"]["keep"])
    bar.close()

    summary = {"arm": arm.name, "model": model_cfg.get("name"), "steps": max(start, steps),
               "drift_metric": rl["drift_metric"], "alarm_step": alarm.alarm_step,
               "collapse_step": collapse.collapse_step,
               "lead_steps": lead_steps(alarm.alarm_step, collapse.collapse_step),
               **_final_rewards(jsonl), "reward_peak_ewma": collapse.peak,
               "drift": alarm.state_dict(), "collapse": collapse.state_dict(), "run_id": run_id,
               "segments": [json.loads(l) for l in (out / "segments.jsonl").read_text().splitlines() if l],
               "definitions": {"alarm": f"one-sided CUSUM on log({rl['drift_metric']}) vs its warm-up median/MAD "
                                        f"(minite.rl.drift; warmup {alarm.warmup}, kappa {alarm.kappa}, h {alarm.h})",
                               "collapse": f"reward EWMA(alpha={collapse.alpha}) < {collapse.frac} x peak",
                               "lead_steps": "collapse_step - alarm_step"},
               "provenance": provenance(device)}
    write_json(out / "stability_summary.json", summary)
    return summary


def _one_step(step, task, trainer, sampler, sync, loss_fn, reference, rl, gen, P, G) -> dict:
    problems = task.train_batch(step, P)
    t0 = time.perf_counter()
    ro = rollout(task, sampler, problems, G, max_new_tokens=rl["max_new_tokens"], temperature=rl["temperature"],
                 top_p=rl["top_p"], generator=gen)
    t1 = time.perf_counter()
    logp_t = trainer.logprobs(ro.tokens, ro.attention_mask).detach().float().cpu()   # [B, L-1]
    t2 = time.perf_counter()
    mm = mismatch_metrics(ro.sampler_logprobs, align_trainer_logprobs(logp_t), ro.response_mask)

    rewards = ro.rewards.view(P, G)
    adv = group_advantages(rewards, std_normalize=rl["std_normalize"]).reshape(-1)
    n_resp_tokens = int(ro.response_mask.sum())
    denom = n_resp_tokens if rl["agg"] == "token-mean" else P * G
    batch = {"input_ids": ro.tokens, "attention_mask": ro.attention_mask, "loss_mask": ro.response_mask,
             "old_logprobs": logp_t, "advantages": adv, "sampler_logprobs": ro.sampler_logprobs[:, 1:],
             "loss_denominator": torch.full((P * G,), float(denom))}
    if reference is not None:
        batch["ref_logprobs"] = reference.logprobs(ro.tokens, ro.attention_mask).detach().float().cpu()
    upd = trainer.update(batch, loss_fn=_undo_slice_weighting(loss_fn, P * G))
    t3 = time.perf_counter()
    synced = sync(trainer, sampler) or {}
    t4 = time.perf_counter()

    resp = ro.response_mask.bool()
    all_tokens = int(ro.attention_mask.sum())
    rec = {
        "step": step,
        "reward_mean": float(ro.rewards.mean()),
        "accuracy": sequence_accuracy(ro.rewards, G),
        "pass_at_group": float((rewards.max(1).values > 0).float().mean()),
        "frac_zero_adv_groups": float((rewards.std(1) == 0).float().mean()),
        "response_len_mean": float(ro.response_lens.float().mean()),
        "entropy_sampler_mc": float(-ro.sampler_logprobs[resp].mean()),
        "loss": float(upd["loss"]),
        "grad_norm": float(upd["grad_norm"]),
        "n_response_tokens": n_resp_tokens,
        **{k: v for k, v in mm.items()},
    }
    if rl["tis_cap"] is not None:
        w = tis_weights(logp_t, ro.sampler_logprobs[:, 1:], rl["tis_cap"])[ro.response_mask[:, 1:].bool()]
        rec.update(tis_weight_mean=float(w.mean()), tis_frac_capped=float((w >= rl["tis_cap"]).float().mean()))
    for name, secs, toks in (("generate", t1 - t0, n_resp_tokens), ("score", t2 - t1, all_tokens),
                             ("update", t3 - t2, all_tokens), ("sync", t4 - t3, None)):
        rec[f"{name}_s"] = secs
        if toks is not None:
            rec[f"{name}_tokens_per_s"] = toks / secs if secs > 0 else None
    for k, v in (upd.get("times") or {}).items():
        rec[f"update_{k}_s"] = None if v is None else float(v)
    if synced.get("bytes"):
        rec["sync_bytes"] = int(synced["bytes"])
        rec["sync_bytes_per_s"] = synced["bytes"] / (t4 - t3) if t4 > t3 else None
    rec["step_s"] = t4 - t0
    for k, v in rec.items():
        if isinstance(v, float) and not math.isfinite(v) and not is_timing_key(k):
            raise FloatingPointError(f"step {step}: {k} is {v} (NaN/Inf) — the run diverged numerically")
    return rec


def _undo_slice_weighting(loss_fn, rows: int):
    """``Trainer.update`` treats a custom loss as a per-slice mean and multiplies it by the slice's share of
    rows; our slice loss is already its exact share of the whole batch's token mean (``loss_denominator``),
    so divide the share back out: the micro-batch losses then add up to exactly the full-batch loss."""
    def fn(logprobs, sub):
        return loss_fn(logprobs, sub) * (rows / logprobs.shape[0])
    return fn


def _reference(arm, model_cfg, device, seed, init):
    """A frozen copy of the warm start (only when rl.beta > 0): the KL reference."""
    from minite.rl.common import _ckpt, _engine_modules
    Trainer = _engine_modules()[0]
    return Trainer(arm, model_cfg, device=device, seed=seed, checkpoint=_ckpt(init))


# --- checkpoints ----------------------------------------------------------------------------------
def checkpoints(out) -> list[tuple[int, Path]]:
    """Complete checkpoints (their loop_state.json exists), oldest first."""
    d = Path(out) / "ckpt"
    found = []
    for p in d.glob(f"{CKPT_PREFIX}*") if d.is_dir() else []:
        suffix = p.name[len(CKPT_PREFIX):]
        if suffix.isdigit() and (p / "loop_state.json").is_file():
            found.append((int(suffix), p))
    return sorted(found)


def latest_checkpoint(out) -> Path | None:
    ck = checkpoints(out)
    return ck[-1][1] if ck else None


def save_checkpoint(out, step, trainer, gen, alarm, collapse, wall_s, keep=None) -> Path:
    d = Path(out) / "ckpt"
    final = d / f"{CKPT_PREFIX}{step:06d}"
    tmp = d / f".tmp_{CKPT_PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save(str(tmp / "trainer"))
    state = {"step": step, "data_position": step, "wall_s": wall_s,
             "generator": base64.b64encode(gen.get_state().numpy().tobytes()).decode(),
             "drift": alarm.state_dict(), "collapse": collapse.state_dict()}
    write_json(tmp / "loop_state.json", state)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep:
        for _, old in checkpoints(out)[:-int(keep)]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the lines of steps <= last_step (those after the checkpoint are recomputed)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            break                       # a torn last line from a kill: drop it and everything after
    write_text(path, "".join(l + "\n" for l in keep))


def _check_run_id(out: Path, run_id: str) -> None:
    meta = out / "run.json"
    if meta.is_file() and latest_checkpoint(out) is not None:
        old = json.loads(meta.read_text()).get("run_id")
        if old != run_id:
            raise RuntimeError(f"{out} holds checkpoints of a different run (run_id {old} != {run_id}: arm, "
                               f"model, config, seed or init changed); use a new --out or delete it")


def _final_rewards(jsonl: Path) -> dict:
    rows = [json.loads(l) for l in jsonl.read_text().splitlines()] if jsonl.exists() else []
    last = rows[-10:]
    return {"final_reward": rows[-1]["reward_mean"] if rows else None,
            "final_reward_last10": sum(r["reward_mean"] for r in last) / len(last) if last else None,
            "final_reward_ewma": rows[-1].get("reward_ewma") if rows else None}
