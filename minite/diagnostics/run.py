"""The engine-facing side of the diagnostics: build an arm's engine pair, sample, score, measure.

    prompts_for(model_cfg, n, seed)       the task's held-out prompts (char models) or seeded random ones
    build_pair(arm, model_cfg, ...)       (trainer, sampler): same weights, synced, calibrated if static
    sample(sampler, prompts, ...)         the sampler's generation (tokens + its own log-probs)
    measure(trainer, sampler, tokens...)  mismatch metrics of the pair on fixed tokens (decode-path replay)
    diagnose_arm(...)                     everything the ``diagnose`` job writes, as Python objects
    attribution_table(...)                naive -> aligned cause attribution on one fixed token set

Every arm of one call starts from the same weights (same seed / checkpoint) and scores the same prompts.
"""
from __future__ import annotations

import time

import pandas as pd
import torch
from tqdm import tqdm

from minite.diagnostics import attribution as A
from minite.diagnostics.localise import attention_mask_for, localise
from minite.diagnostics.metrics import align_trainer_logprobs, mismatch_metrics
from minite.engines.arms import Arm, load_arm


def prompts_for(model_cfg: dict, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: the arithmetic task's held-out problems for char-tokenizer models (configs/rl/cpu.yaml
    task), else seeded random token prompts of 12 tokens after BOS (real checkpoints bring their own data)."""
    if model_cfg.get("tokenizer") == "char":
        from minite.rl.task import ArithmeticTask
        task = ArithmeticTask(digits=2, ops=("+",), seed=seed, n_heldout=max(128, n))
        return [task.encode_prompt(p) for p in task.heldout(n)]
    g = torch.Generator().manual_seed(seed)
    hi = int(model_cfg["vocab_size"])
    return [[1] + torch.randint(3, hi, (12,), generator=g).tolist() for _ in range(n)]


def needs_calibration(arm: Arm) -> bool:
    act = arm.sampler.activations
    return arm.sampler.is_nvfp4 and act is not None and act.scaling == "static"


def build_pair(arm: Arm, model_cfg: dict, device: str = "cpu", seed: int = 0, checkpoint=None,
               calibration_prompts=None, max_batch: int = 64, max_seq_len: int | None = None):
    """(trainer, sampler) of ``arm``: the trainer's weights synced to the sampler, which is calibrated on
    ``calibration_prompts`` when its activations use static scales (vLLM/ModelOpt calibrate once)."""
    from minite.engines.sampler import Sampler
    from minite.engines.sync import sync_weights
    from minite.engines.trainer import Trainer

    trainer = Trainer(arm, model_cfg, device=device, seed=seed, checkpoint=checkpoint)
    sampler = Sampler(arm, model_cfg, device=device, max_batch=max_batch, max_seq_len=max_seq_len)
    sync_weights(trainer, sampler)
    if needs_calibration(arm):
        if not calibration_prompts:
            raise ValueError(f"arm {arm.name}: static activation scales need calibration prompts")
        sampler.calibrate(calibration_prompts)
    return trainer, sampler


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


def diagnose_arm(arm: Arm, model_cfg: dict, *, device="cpu", seed=0, checkpoint=None, n_prompts=16,
                 max_new_tokens=8, temperature=1.0) -> dict:
    """Sample with the arm's sampler, then: token-level mismatch against the trainer (the sampler's own
    generation log-probs, as an RL step sees them), and per-layer/op localisation on those tokens."""
    prompts = prompts_for(model_cfg, n_prompts, seed)
    width = max(len(p) for p in prompts) + max_new_tokens
    trainer, sampler = build_pair(arm, model_cfg, device, seed, checkpoint, prompts, max_batch=len(prompts),
                                  max_seq_len=width + 1)
    out = sample(sampler, prompts, max_new_tokens, seed, temperature)
    loc = localise(trainer, sampler, out.tokens.cpu(), out.prompt_lens.cpu(), out.response_mask.cpu())
    resp = out.response_mask.cpu()
    metrics = mismatch_metrics(out.logprobs.cpu(), align_trainer_logprobs(loc["logp_t"].cpu()), resp)
    replay = float((loc["logp_s"].cpu() - out.logprobs.cpu())[resp.bool()].abs().max())
    return {"metrics": metrics, "layers": loc["table"], "first_divergence": loc["first_divergence"],
            "score_replay_max_abs_diff": replay, "captured": loc["captured"], "prompts": prompts,
            "tokens": out.tokens.cpu(), "prompt_lens": out.prompt_lens.cpu(), "response_mask": resp}


def attribution_table(model_cfg: dict, *, device="cpu", seed=0, checkpoint=None, n_prompts=8,
                      max_new_tokens=8, temperature=1.0, metric="k3", progress=True):
    """(attribution DataFrame, per-subset metrics DataFrame). Tokens: generated once by the naive arm's
    sampler; every one of the 32 cause subsets scores exactly those tokens (decode-path replay)."""
    prompts = prompts_for(model_cfg, n_prompts, seed)
    width = max(len(p) for p in prompts) + max_new_tokens
    kw = dict(device=device, seed=seed, checkpoint=checkpoint, calibration_prompts=prompts,
              max_batch=len(prompts), max_seq_len=width + 1)
    A.all_causes_arm()  # refuse early if naive + every cause is not minite_nvfp4
    _, naive_sampler = build_pair(load_arm("naive_te_nvfp4"), model_cfg, **kw)
    out = sample(naive_sampler, prompts, max_new_tokens, seed, temperature)
    tokens, plens, resp = out.tokens.cpu(), out.prompt_lens.cpu(), out.response_mask.cpu()
    rows = []
    bar = tqdm(total=2 ** len(A.CAUSES), desc="attribution subsets", disable=not progress)

    def v(causes: frozenset) -> float:
        t0 = time.perf_counter()
        arm = A.subset_arm(causes)
        trainer, sampler = build_pair(arm, model_cfg, **kw)
        m = measure(trainer, sampler, tokens, plens, resp)
        rows.append({"subset": A.subset_name(causes), **{c: c in causes for c in A.CAUSES}, **m,
                     "time_s": time.perf_counter() - t0})
        bar.update(1)
        return m[metric]

    try:
        table = A.attribute(v)
    finally:
        bar.close()
    return table, pd.DataFrame(rows)
