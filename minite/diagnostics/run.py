"""The engine-facing side of the diagnostics: sample with an arm's sampler, score with both engines, measure.

    sample(sampler, prompts, ...)         the sampler's generation (tokens + its own log-probs)
    measure(trainer, sampler, tokens...)  mismatch metrics of the pair on fixed tokens (decode-path replay)
    diagnose_arm(arm, model_cfg, task)    everything the ``diagnose`` job writes, as Python objects
    attribution_table(model_cfg, task)    naive -> aligned cause attribution on one fixed token set (base arm:
                                          naive_te_nvfp4, or any other, e.g. naive_te_nvfp4_blanket)

Engines come from ``minite.engines.build_engines``; prompts from the task (``minite.tasks``): its first
held-out prompts. A sampler with static activation scales calibrates on those same prompts (the most
favourable calibration it can get, so the gap measured is not one of calibration data). Every arm of one call
starts from the same weights (same seed / checkpoint) and scores the same prompts.
"""
from __future__ import annotations

import time

import pandas as pd
import torch
from tqdm import tqdm

from minite.diagnostics import attribution as A
from minite.diagnostics.localise import attention_mask_for, localise
from minite.diagnostics.metrics import align_trainer_logprobs, mismatch_metrics
from minite.engines import build_engines
from minite.engines.arms import Arm, load_arm


def _engines(arm: Arm, model_cfg: dict, prompts, max_new_tokens: int, device, seed, checkpoint):
    """(trainer, sampler) sized for ``prompts`` + ``max_new_tokens``, calibrated on the prompts if static."""
    width = max(len(p) for p in prompts) + max_new_tokens
    return build_engines(arm, model_cfg, device=device, seed=seed, checkpoint=checkpoint,
                         calibration_prompts=prompts, max_batch=len(prompts), max_seq_len=width + 1)


def sample(sampler, prompts, max_new_tokens: int, seed: int = 0, temperature: float = 1.0):
    g = torch.Generator(device=sampler.device).manual_seed(seed)
    return sampler.generate(prompts, max_new_tokens, temperature=temperature, generator=g)


def measure(trainer, sampler, tokens, prompt_lens, response_mask) -> dict:
    """Mismatch metrics of the pair on given tokens: sampler log-probs by decode-path replay
    (``sampler.score``), trainer log-probs teacher-forced."""
    tokens, response_mask = torch.as_tensor(tokens).cpu(), torch.as_tensor(response_mask).cpu()
    att = attention_mask_for(tokens, prompt_lens, response_mask)
    logp_s = sampler.score(tokens.to(sampler.device), prompt_lens).cpu()
    logp_t = align_trainer_logprobs(trainer.logprobs(tokens.to(trainer.device), att.to(trainer.device)).cpu())
    return mismatch_metrics(logp_s, logp_t, response_mask)


def diagnose_arm(arm: Arm, model_cfg: dict, task, *, device="cpu", seed=0, checkpoint=None, n_prompts=16,
                 max_new_tokens=8, temperature=1.0) -> dict:
    """Sample with the arm's sampler, then: token-level mismatch against the trainer (the sampler's own
    generation log-probs, as an RL step sees them), and per-layer/op localisation on those tokens."""
    prompts = task.heldout_prompts(n_prompts)
    trainer, sampler = _engines(arm, model_cfg, prompts, max_new_tokens, device, seed, checkpoint)
    out = sample(sampler, prompts, max_new_tokens, seed, temperature)
    loc = localise(trainer, sampler, out.tokens.cpu(), out.prompt_lens.cpu(), out.response_mask.cpu())
    resp = out.response_mask.cpu()
    metrics = mismatch_metrics(out.logprobs.cpu(), align_trainer_logprobs(loc["logp_t"].cpu()), resp)
    replay = float((loc["logp_s"].cpu() - out.logprobs.cpu())[resp.bool()].abs().max())
    return {"metrics": metrics, "layers": loc["table"], "first_divergence": loc["first_divergence"],
            "score_replay_max_abs_diff": replay, "captured": loc["captured"], "prompts": prompts,
            "tokens": out.tokens.cpu(), "prompt_lens": out.prompt_lens.cpu(), "response_mask": resp}


def attribution_table(model_cfg: dict, task, *, device="cpu", seed=0, checkpoint=None, n_prompts=8,
                      max_new_tokens=8, temperature=1.0, metric="k3", progress=True, naive: str | Arm = A.NAIVE):
    """(attribution DataFrame, per-subset metrics DataFrame). Tokens: generated once by the base (naive) arm's
    sampler; every subset of its active causes (``attribution.active_causes``) scores exactly those tokens
    (decode-path replay)."""
    prompts = task.heldout_prompts(n_prompts)
    base = load_arm(naive) if isinstance(naive, str) else naive
    A.all_causes_arm(base)  # refuse early if naive + every cause is not minite_nvfp4
    causes = A.active_causes(base)
    _, naive_sampler = _engines(base, model_cfg, prompts, max_new_tokens, device, seed, checkpoint)
    out = sample(naive_sampler, prompts, max_new_tokens, seed, temperature)
    tokens, plens, resp = out.tokens.cpu(), out.prompt_lens.cpu(), out.response_mask.cpu()
    rows = []
    bar = tqdm(total=2 ** len(causes), desc="attribution subsets", disable=not progress)

    def v(causes: frozenset) -> float:
        t0 = time.perf_counter()
        arm = A.subset_arm(causes, base)
        trainer, sampler = _engines(arm, model_cfg, prompts, max_new_tokens, device, seed, checkpoint)
        m = measure(trainer, sampler, tokens, plens, resp)
        rows.append({"subset": A.subset_name(causes), **{c: c in causes for c in A.CAUSES}, **m,
                     "time_s": time.perf_counter() - t0})
        bar.update(1)
        return m[metric]

    try:
        table = A.attribute(v, causes)
    finally:
        bar.close()
    return table, pd.DataFrame(rows)
