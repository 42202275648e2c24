"""The long-horizon GRPO stability run: one arm, N steps, checkpoints every k, resumable, drift alarm.

One step (docs/ENGINES.md):
  1. generate  the sampler draws a group of G responses per prompt, with its own log-probs
  2. reward    exact answer check (``task.reward``)
  3. score     the trainer recomputes the sampled tokens' log-probs (``trainer.logprobs``): these are the
               PPO "old" log-probs (no importance-sampling correction unless ``rl.tis_cap`` is set), and
               against the sampler's they give the mismatch metrics (``minite.diagnostics.metrics``)
  4. update    ``trainer.update(batch, loss_fn=make_loss_fn(...))`` (``grpo.token_loss_sum`` under the
               trainer's loss contract; one learner update per step)
  5. sync      ``sync_weights(trainer, sampler)``
and one JSONL line per step (``stability.jsonl``; keys ending in ``_s`` / ``_per_s`` are timings, everything
else is a deterministic function of the seed). Phases: ``generate_s`` = sampling + reward checking,
``score_s`` = the trainer's log-prob recompute, ``update_s`` = the learner update, ``sync_s`` = the weight
sync (``sync_bytes`` shipped; under torchrun ``sync_gather_bytes`` all-gathered per rank);
``*_tokens_per_s`` = response tokens (generate) or all tokens (score, update) per second. Entropy is the
SAMPLER-side Monte-Carlo estimate: minus the mean log-prob of the sampled response tokens under the
distribution they were sampled from. The drift measurements beside the mismatch metrics (response lengths,
the max-|dlogp| token's probabilities, router top-k disagreement, in-run held-out accuracy) are
``minite.rl.step_metrics``, one call per step before the update; ``metrics_s`` is their time. The drift alarm
runs on ``rl.drift_metric`` and, through ``DriftWatch``, on each metric of ``metrics.watch``; the summary's
``alarms`` gives each one's alarm step.

Determinism and resume: the prompts of step s are a pure function of (seed, s); sampling draws from one
``torch.Generator`` whose state is checkpointed; ``trainer.save`` holds model + optimizer + RNG. A checkpoint
``ckpt/step_XXXXXX/`` = trainer state + ``loop_state.json`` (step, data position, generator state, drift
alarm and collapse detector states, accumulated wall time), written to a temporary directory and renamed
into place, so a kill never leaves a half checkpoint. On restart the run resumes from the newest complete
checkpoint, drops the JSONL lines after it and recomputes them: with ``ckpt.every = 1`` at most the step in
flight is lost, and the curve is the same as an uninterrupted run's. Every invocation appends one line to
``segments.jsonl`` (the step it resumed from, the target, its provenance). The directory layout, the lock
and the checkpoint I/O are ``minite.rl.checkpoints``.

Under torchrun (several processes) every rank runs the loop: its sampler replica answers its share of the
step's rows and its trainer shard trains on them (``minite.rl.data_parallel``); every rank sees the whole
step, and rank 0 alone writes the step log, run.json, segments and the summary. Checkpoints hold each rank's
trainer shards (DCP) and sampling generator; a run resumes with the same number of processes (the number is
part of the run's identity when above one).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minite import distributed as D
from minite.diagnostics.metrics import align_trainer_logprobs, mismatch_metrics
from minite.engines.models import check_positions
from minite.engines.sync import sync_weights
from minite.provenance import append_jsonl, provenance, write_json
from minite.rl import checkpoints as ck
from minite.rl import data_parallel as dp
from minite.rl.drift import CollapseDetector, DriftAlarm, DriftWatch, lead_steps
from minite.rl.grpo import group_advantages, make_loss_fn, tis_weights
from minite.rl.rollout import sequence_accuracy
from minite.rl.spec import RunSpec, stored_path
from minite.rl.step_metrics import StepMetrics

log = logging.getLogger(__name__)


def is_timing_key(k: str) -> bool:
    return k.endswith("_s") or k.endswith("_per_s")


@dataclass(frozen=True)
class StepConfig:
    """What one GRPO step does (the ``rl`` section of the RL config)."""

    prompts: int                # distinct prompts per step (P)
    group_size: int             # samples per prompt (G)
    max_new_tokens: int
    temperature: float
    top_p: float
    std_normalize: bool
    tis_cap: float | None
    drift_metric: str

    @classmethod
    def from_config(cls, rl: dict) -> StepConfig:
        if rl["temperature"] != 1.0:
            raise ValueError("rl.temperature must be 1.0: the trainer scores at temperature 1, so the mismatch "
                             "metrics and PPO ratios would compare different distributions")
        return cls(int(rl["prompts_per_step"]), int(rl["group_size"]), int(rl["max_new_tokens"]),
                   float(rl["temperature"]), float(rl["top_p"]), bool(rl["std_normalize"]), rl["tis_cap"],
                   rl["drift_metric"])


def _after_step(step: int) -> None:
    """Called after a step's JSONL line is written and before its checkpoint. Does nothing; the tests replace
    it to kill a run at exactly that point."""


def run_stability(spec: RunSpec, out_dir, steps: int, *, ckpt_every: int | None = None,
                  progress: bool = True) -> dict:
    """Run (or resume) ``steps`` GRPO steps of ``spec``; returns the summary dict (also written to disk)."""
    out, main = Path(out_dir), D.is_main()
    sc = StepConfig.from_config(spec.cfg["rl"])           # config errors before the directory exists
    check_positions(spec.model_cfg, spec.task.max_prompt_len + sc.max_new_tokens,
                    f"task.max_prompt_len ({spec.task.max_prompt_len}) + rl.max_new_tokens ({sc.max_new_tokens})")
    # rank 0 alone creates the directory: another rank could re-create it after rank 0 removed it on failure
    created = main and not out.exists()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    D.barrier()
    try:
        with ck.single_writer(out) if main else contextlib.nullcontext():
            return _run(spec, sc, out, steps, int(ckpt_every or spec.cfg["ckpt"]["every"]), progress)
    except ck.RunDirectoryError:
        raise                   # another writer's run (it may have made the directory at the same moment)
    except BaseException:
        if created:
            _remove_unfinished(out)
        raise


# what a run writes before its first checkpoint (the lock is the writer's own)
_RUN_FILES = ("run.json", "segments.jsonl", "stability.jsonl", "stability_summary.json")


def _remove_unfinished(out: Path) -> None:
    """A run that fails before its first checkpoint in a directory it created (a bad checkpoint, a config the
    engines refuse only in step 1) has nothing to resume from: remove what it wrote, so no half-made "run" is
    left for eval or the report to pick up. Other files, and any run with a checkpoint, stay."""
    if ck.checkpoints(out):
        return
    for name in _RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "ckpt", ignore_errors=True)     # at most a temporary, incomplete checkpoint
    if not any(out.iterdir()):
        out.rmdir()


class _Loop:
    """The engines, the loss and the sampling generator of a run: ``step(s)`` runs GRPO step s."""

    def __init__(self, spec: RunSpec, sc: StepConfig):
        rl = spec.cfg["rl"]
        self.task, self.sc = spec.task, sc
        rows = D.row_share(sc.prompts * sc.group_size, "rollout rows (rl.prompts_per_step x rl.group_size)")
        self.trainer, self.sampler = spec.engines(max_batch=rows.stop - rows.start,
                                                  max_seq_len=spec.task.max_prompt_len + sc.max_new_tokens)
        self.loss_fn = make_loss_fn(rl["clip_low"], rl["clip_high"], rl["beta"], rl["tis_cap"], rl["agg"])
        self.reference = spec.reference() if rl["beta"] else None
        # one sampling stream per rank (rank 0's is the single-process one)
        self.gen = torch.Generator(device=spec.device).manual_seed(spec.seed + 1_000_003 * D.rank())
        self.metrics = StepMetrics(spec.cfg, spec.task, max_new_tokens=sc.max_new_tokens, seed=spec.seed,
                                   max_seq_len=spec.task.max_prompt_len + sc.max_new_tokens,
                                   max_batch=sc.prompts * sc.group_size)

    def step(self, step: int) -> dict:
        sc, task, trainer = self.sc, self.task, self.trainer
        P, G = sc.prompts, sc.group_size
        problems = task.train_batch(step, P)
        t0 = time.perf_counter()
        ro = dp.rollout_rows(task, self.sampler, problems, G, max_new_tokens=sc.max_new_tokens,
                             temperature=sc.temperature, top_p=sc.top_p, generator=self.gen)
        t1 = time.perf_counter()
        logp_t = dp.logprobs(trainer, ro.tokens, ro.attention_mask)   # [B, L-1]
        t2 = time.perf_counter()
        mm = mismatch_metrics(ro.sampler_logprobs, align_trainer_logprobs(logp_t), ro.response_mask)
        drift = self.metrics(step, ro, logp_t, trainer, self.sampler)          # minite.rl.step_metrics
        t2m = time.perf_counter()

        rewards = ro.rewards.view(P, G)
        adv = group_advantages(rewards, std_normalize=sc.std_normalize).reshape(-1)
        n_resp_tokens = int(ro.response_mask.sum())
        batch = {"input_ids": ro.tokens, "attention_mask": ro.attention_mask, "loss_mask": ro.response_mask,
                 "old_logprobs": logp_t, "advantages": adv, "sampler_logprobs": ro.sampler_logprobs[:, 1:]}
        if self.reference is not None:
            batch["ref_logprobs"] = dp.logprobs(self.reference, ro.tokens, ro.attention_mask)
        upd = trainer.update(dp.local_rows(batch, P * G), loss_fn=self.loss_fn)
        t3 = time.perf_counter()
        synced = sync_weights(trainer, self.sampler) or {}
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
            **mm,
            **drift,
        }
        if sc.tis_cap is not None:
            w = tis_weights(logp_t, ro.sampler_logprobs[:, 1:], sc.tis_cap)[ro.response_mask[:, 1:].bool()]
            rec.update(tis_weight_mean=float(w.mean()), tis_frac_capped=float((w >= sc.tis_cap).float().mean()))
        for name, secs, toks in (("generate", t1 - t0, n_resp_tokens), ("score", t2 - t1, all_tokens),
                                 ("update", t3 - t2m, all_tokens), ("sync", t4 - t3, None)):
            rec[f"{name}_s"] = secs
            if toks is not None:
                rec[f"{name}_tokens_per_s"] = toks / secs if secs > 0 else None
        for k, v in (upd.get("times") or {}).items():
            rec[f"update_{k}_s"] = None if v is None else float(v)
        if synced.get("bytes"):
            rec["sync_bytes"] = int(synced["bytes"])
            rec["sync_bytes_per_s"] = synced["bytes"] / (t4 - t3) if t4 > t3 else None
        if synced.get("gather_bytes"):       # several processes: bytes each rank received in the all-gathers
            rec["sync_gather_bytes"] = int(synced["gather_bytes"])
        rec["step_s"] = t4 - t0
        for k, v in rec.items():
            if isinstance(v, float) and not math.isfinite(v) and not is_timing_key(k):
                raise FloatingPointError(f"step {step}: {k} is {v} (NaN/Inf) — the run diverged numerically")
        return rec


def _run(spec: RunSpec, sc: StepConfig, out: Path, steps: int, every: int, progress: bool) -> dict:
    arm, cfg = spec.arm, spec.cfg
    run_id = spec.run_id()
    ck.check_run_id(out, run_id)
    cks = D.broadcast_object(ck.checkpoints(out))     # rank 0's view of the directory decides
    done, last = cks[-1] if cks else (0, None)
    if done > steps:  # else a lowered --steps (a pipeline config set back) keeps the longer run without a word
        raise ValueError(f"{out} already holds {done} steps; --steps {steps} cannot shorten a run: give --steps "
                         f">= {done}, or a new --out (delete {out} to start over)")
    loop = _Loop(spec, sc)
    alarm, collapse = DriftAlarm(**cfg["drift"]), CollapseDetector(**cfg["collapse"])
    watch = DriftWatch(cfg["metrics"]["watch"], **cfg["drift"])
    jsonl = out / "stability.jsonl"
    start, wall0 = 0, 0.0
    if last is not None:
        state = ck.load_checkpoint(last, loop.trainer)
        sync_weights(loop.trainer, loop.sampler)
        ck.restore_generator(loop.gen, ck.rank_generator_state(state))
        alarm.load_state_dict(state["drift"])
        collapse.load_state_dict(state["collapse"])
        watch.load_state_dict(state.get("watch"))
        start, wall0 = int(state["step"]), float(state["wall_s"])
    main = D.is_main()
    prov = {**provenance(spec.device), **({"world_size": D.world_size()} if D.world_size() > 1 else {})}
    if main:
        if start < steps:       # new steps: the old summary no longer describes the directory (a kill mid-way)
            (out / "stability_summary.json").unlink(missing_ok=True)
        ck.truncate_jsonl(jsonl, start)
        stored_cfg = {**cfg, "_source": stored_path(cfg["_source"])} if cfg.get("_source") else cfg
        write_json(out / "run.json", {"run_id": run_id, "arm": arm.name, "model": spec.model_cfg.get("name"),
                                      "init": spec.init_path, "seed": spec.seed, "config": stored_cfg,
                                      "task": spec.task.config(), "resumed_from": start, "provenance": prov})
        # run.json describes the latest invocation only; segments.jsonl keeps every one (a long run done in
        # several jobs, each possibly from another commit) -- a scheduler may clear the job's log between them.
        append_jsonl(out / "segments.jsonl",
                     {"resumed_from": start, "target_steps": steps, "run_id": run_id, **prov})
    if start:
        log.info("rl %s: resuming from checkpoint step %d (wall %.1f s so far)", arm.name, start, wall0)

    t_run = time.perf_counter()
    bar = tqdm(range(start + 1, steps + 1), desc=f"rl {arm.name}", disable=not (progress and main), initial=start,
               total=steps, unit="step")
    for step in bar:
        rec = loop.step(step)
        rec.update(alarm.update(step, rec[sc.drift_metric]))
        rec.update(collapse.update(step, rec["reward_mean"]))
        rec.update(watch.update(step, rec))
        rec["wall_s"] = wall0 + time.perf_counter() - t_run
        if main:
            append_jsonl(jsonl, {"arm": arm.name, **rec})
        bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", k3=f"{rec['k3']:.2e}")
        _after_step(step)
        if step % every == 0 or step == steps:
            state = {"step": step, "data_position": step, "wall_s": rec["wall_s"],
                     **ck.generator_states(loop.gen), "drift": alarm.state_dict(),
                     "collapse": collapse.state_dict(), "watch": watch.state_dict()}
            ck.save_checkpoint(out, step, loop.trainer, state, cfg["ckpt"]["keep"])
    bar.close()
    if not main:
        return D.broadcast_object(None)

    summary = {"arm": arm.name, "model": spec.model_cfg.get("name"), "steps": max(start, steps),
               "drift_metric": sc.drift_metric, "alarm_step": alarm.alarm_step,
               "alarms": {sc.drift_metric: alarm.alarm_step, **watch.alarm_steps()},
               "collapse_step": collapse.collapse_step,
               "lead_steps": lead_steps(alarm.alarm_step, collapse.collapse_step),
               **_final_rewards(jsonl), "reward_peak_ewma": collapse.peak,
               "drift": alarm.state_dict(), "collapse": collapse.state_dict(), "run_id": run_id,
               "segments": [json.loads(line) for line in (out / "segments.jsonl").read_text().splitlines() if line],
               "definitions": {"alarm": f"one-sided CUSUM on log({sc.drift_metric}) vs its warm-up median/MAD "
                                        f"(minite.rl.drift; warmup {alarm.warmup}, kappa {alarm.kappa}, h {alarm.h})",
                               "alarms": "the same CUSUM on each metric of metrics.watch (its own log floor); "
                                         "the step it fired, or null",
                               "collapse": f"reward EWMA(alpha={collapse.alpha}) < {collapse.frac} x peak",
                               "lead_steps": "collapse_step - alarm_step"},
               "provenance": provenance(spec.device)}
    write_json(out / "stability_summary.json", summary)
    return D.broadcast_object(summary)


def _final_rewards(jsonl: Path) -> dict:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    last = rows[-10:]
    return {"final_reward": rows[-1]["reward_mean"] if rows else None,
            "final_reward_last10": sum(r["reward_mean"] for r in last) / len(last) if last else None,
            "final_reward_ewma": rows[-1].get("reward_ewma") if rows else None}
