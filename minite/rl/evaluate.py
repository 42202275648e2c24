"""Held-out evaluation: mean@k accuracy of an arm's SAMPLER at each checkpoint of a stability run.

For every checkpoint (step 0 = the warm start the run began from, then ``ckpt/step_XXXXXX``) the trainer
state is loaded and synced to the sampler exactly as during RL, then the sampler draws k samples per
held-out prompt at the configured temperature / top-p. mean@k = mean over prompts of the fraction of a
prompt's k samples that are exactly right (an unbiased estimate of the expected single-sample accuracy).
Sampling uses its own generator seeded by (seed, step), so an evaluation is reproducible and independent of
the RL run's random state. Rows: arm, step, k, mean_at_k, pass_at_k, n_prompts, temperature, sha, device, date.

Under torchrun every rank loads and syncs each checkpoint (the sharded trainer), its sampler replica answers
every N-th prompt with its own stream, and rank 0 writes the CSV of all of them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from minite import distributed as D
from minite.engines.models import check_positions
from minite.engines.sync import sync_weights
from minite.provenance import provenance, read_json, write_csv
from minite.rl.checkpoints import checkpoints, load_trainer
from minite.rl.rollout import rollout
from minite.rl.spec import RunSpec, resolve_stored_path

COLUMNS = ["arm", "step", "k", "mean_at_k", "pass_at_k", "n_prompts", "temperature", "sha", "device", "date"]


def evaluate_run(spec: RunSpec, run_dir, out_csv, *, steps: list[int] | None = None,
                 progress: bool = True) -> pd.DataFrame:
    """Evaluate the checkpoints of ``run_dir`` (and step 0 = the warm start) and write ``out_csv`` atomically.
    Without ``spec.init`` the warm start is the one the run's run.json names. A ``run_dir`` that holds no run
    yet, given a warm start (``spec.init`` or the model config's checkpoint), evaluates that warm start alone:
    step 0 before any RL (the drift study's difficulty calibration)."""
    run_dir = Path(run_dir)
    meta, cks = run_dir / "run.json", checkpoints(run_dir)
    warm_start = spec.init is not None or spec.model_cfg.get("checkpoint")
    if not meta.is_file() and not cks and not warm_start:  # else step 0 would be a fresh model's accuracy
        raise FileNotFoundError(f"{run_dir}: not a run directory (no run.json, no checkpoints) and no --checkpoint "
                                "to evaluate; python -m minite rl --out writes a run")
    run = read_json(meta, "rerun the same `python -m minite rl` command to rewrite it") if meta.is_file() else None
    if run is not None:
        check_same_task(spec, run, meta)
    if spec.init is None and run is not None:
        init = run.get("init")
        spec = dataclasses.replace(spec, init=resolve_stored_path(init) if init else None)
    arm, task, model_cfg, seed, device = spec.arm, spec.task, spec.model_cfg, spec.seed, spec.device
    ev = spec.cfg["eval"]
    check_positions(model_cfg, task.max_prompt_len + ev["max_new_tokens"],
                    f"task.max_prompt_len ({task.max_prompt_len}) + eval.max_new_tokens ({ev['max_new_tokens']})")
    everyone = task.heldout(ev["n_prompts"])
    problems = everyone[D.rank()::D.world_size()]      # this rank's prompts (all of them in one process)
    k = int(ev["k"])
    todo = ([(0, None)] if spec.init is not None or model_cfg.get("checkpoint") or not cks else []) + cks
    if steps is not None:
        missing = sorted(set(steps) - {s for s, _ in todo})
        if missing:                      # else the CSV silently lacks them
            raise FileNotFoundError(f"{run_dir}: no checkpoint for step(s) {missing}; it has steps "
                                    f"{[s for s, _ in todo]} (ckpt.keep may have removed older ones)")
        todo = [(s, p) for s, p in todo if s in set(steps)]
    if not todo:
        raise FileNotFoundError(f"{run_dir}: no checkpoints to evaluate (run `python -m minite rl` first)")
    chunk = max(1, min(len(everyone), 256 // k))          # prompts per generate call (x k samples)
    trainer, sampler = spec.engines(max_batch=chunk * k, max_seq_len=task.max_prompt_len + ev["max_new_tokens"])
    prov = provenance(device)
    rows = []
    for step, path in tqdm(todo, desc=f"eval {arm.name}", disable=not progress, unit="ckpt"):
        if path is not None:
            load_trainer(trainer, path / "trainer", f"leave step {step} out of --steps, or delete {path}")
            sync_weights(trainer, sampler)
        rows.append({"arm": arm.name, "step": step, **heldout_accuracy(task, sampler, problems, ev, seed, step, chunk),
                     "temperature": ev["temperature"], "sha": prov["sha"], "device": prov["device"],
                     "date": prov["date"]})
    df = pd.DataFrame(rows, columns=COLUMNS)
    if D.is_main():
        write_csv(out_csv, df)
    return df


def check_same_task(spec: RunSpec, run: dict, meta: Path) -> None:
    """Refuse to evaluate a run on another task or seed than it trained on: the held-out split is keyed by the
    seed, so with another seed "held-out" prompts may be the run's training prompts."""
    if "seed" in run and run["seed"] != spec.seed:
        raise ValueError(f"{meta}: the run used seed {run['seed']}, this evaluation seed {spec.seed} (another "
                         f"held-out split, possibly the run's training prompts); use --seed {run['seed']}")
    mine, theirs = json.loads(json.dumps(spec.task.config())), run.get("task")    # JSON: as run.json holds it
    if theirs is not None and theirs != mine:
        diff = [f"task.{k}: run {theirs.get(k)!r}, here {mine.get(k)!r}"
                for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        raise ValueError(f"{meta}: the run trained on another task ({'; '.join(diff)}); evaluate with its "
                         "--rl-config and task.* --set overrides")


def heldout_accuracy(task, sampler, problems, ev: dict, seed: int, updates: int, chunk: int) -> dict:
    """The sampler's mean@k and pass@k on ``problems`` (the ``eval`` section's k, temperature, top-p and
    max_new_tokens), ``chunk`` prompts (x k samples) per generate call; its own generator, seeded by
    (seed, updates, rank), so an evaluation is reproducible and never touches the RL run's random state. Under
    torchrun ``problems`` is this rank's share; the result pools every rank's.
    Returns {"k", "mean_at_k", "pass_at_k", "n_prompts"}."""
    k = int(ev["k"])
    gen = torch.Generator(device=sampler.device).manual_seed(10_007 * seed + updates + 1_000_003 * D.rank())
    correct = []
    for i in range(0, len(problems), chunk):
        ro = rollout(task, sampler, problems[i:i + chunk], k, max_new_tokens=ev["max_new_tokens"],
                     temperature=ev["temperature"], top_p=ev["top_p"], generator=gen)
        correct.append(ro.rewards.view(-1, k))
    c = torch.cat([x for part in D.all_gather_object(correct) for x in part])   # every rank's share
    return {"k": k, "mean_at_k": float(c.mean(1).mean()), "pass_at_k": float((c.max(1).values > 0).float().mean()),
            "n_prompts": c.shape[0]}
