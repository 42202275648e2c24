"""Shared plumbing for the RL jobs: building both engines of an arm from the SFT warm start, rollouts.

The engines come from docs/ENGINES.md (Trainer, Sampler, sync_weights). Every arm starts from the same
warm-start weights (the bf16 SFT checkpoint, ``minite.rl.sft``); the sampler is then synced from the trainer
and, for arms with static activation scales, calibrated ONCE on a fixed prompt batch (the same on resume,
so a resumed run has the same scales as the uninterrupted one).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from minite.tokenizer import EOS


def _engine_modules():
    try:
        from minite.engines.sampler import Sampler
        from minite.engines.sync import sync_weights
        from minite.engines.trainer import Trainer
    except ImportError as e:  # the engines are a hard dependency of every RL job
        raise RuntimeError(f"minite RL needs the engines (minite.engines.trainer/sampler/sync): {e}") from e
    return Trainer, Sampler, sync_weights


def needs_calibration(arm) -> bool:
    act = arm.sampler.activations
    return arm.sampler.is_nvfp4 and act is not None and act.scaling == "static"


def build_rl_engines(arm, model_cfg: dict, *, device: str = "cpu", seed: int = 0, lr: float = 1e-4,
                     micro_batch_size=None, init: str | Path | None = None, max_batch: int = 64,
                     max_seq_len: int = 64, calib_prompts: list[list[int]] | None = None):
    """(trainer, sampler, sync_weights) for ``arm`` via ``minite.engines.build_engines``, both holding the
    warm-start weights, the sampler calibrated on ``calib_prompts`` when the arm has static scales."""
    from minite.engines import build_engines
    _, _, sync_weights = _engine_modules()
    if needs_calibration(arm) and not calib_prompts:
        raise ValueError(f"arm {arm.name} needs calibration prompts for its static activation scales")
    trainer, sampler = build_engines(arm, model_cfg, device=device, seed=seed,
                                     checkpoint=_ckpt(init),
                                     calibration_prompts=calib_prompts, max_batch=max_batch,
                                     max_seq_len=max_seq_len, lr=lr, micro_batch_size=micro_batch_size)
    return trainer, sampler, sync_weights


def _ckpt(init) -> str | None:
    p = init_weights_path(init) if init else None
    return str(p) if p is not None else None


def init_weights_path(init: str | Path) -> Path | None:
    """The weights of a warm start: an SFT directory (``minite.rl.sft``) or a checkpoint directory as is.
    None when the SFT directory recorded no weights (``sft.steps: 0``: the model config's own checkpoint)."""
    import json
    p = Path(init)
    if (p / "sft.json").is_file():
        if json.loads((p / "sft.json").read_text()).get("weights") is None:
            return None
        p = p / "weights"
    if not p.exists():
        raise FileNotFoundError(f"warm-start checkpoint {str(p)!r} does not exist (run `python -m minite sft`)")
    return p


@dataclass
class Rollout:
    tokens: torch.Tensor            # [B, L] long
    attention_mask: torch.Tensor    # [B, L] 1 on prompt + response tokens
    response_mask: torch.Tensor     # [B, L] 1 on generated tokens (incl. the stop token)
    sampler_logprobs: torch.Tensor  # [B, L] fp32, 0 off the response
    rewards: torch.Tensor           # [B] fp32
    response_lens: torch.Tensor     # [B] long
    gen_s: float = 0.0


def rollout(task, sampler, problems, group_size: int, *, max_new_tokens: int, temperature: float,
            top_p: float, generator: torch.Generator) -> Rollout:
    """Each problem's prompt ``group_size`` times (groups contiguous) -> sampled responses and rewards."""
    prompts = [task.encode_prompt(p) for p in problems for _ in range(group_size)]
    out = sampler.generate(prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                           generator=generator, stop_token=getattr(task, "eos_id", EOS))
    tokens = out.tokens.cpu()
    resp = out.response_mask.cpu().long()
    plens = torch.as_tensor(out.prompt_lens).cpu().long()
    att = torch.zeros_like(tokens)
    for b in range(tokens.shape[0]):
        att[b, : int(plens[b]) + int(resp[b].sum())] = 1
    rewards = torch.tensor([task.reward(problems[b // group_size], tokens[b][resp[b] == 1])
                            for b in range(tokens.shape[0])], dtype=torch.float32)
    return Rollout(tokens, att, resp, out.logprobs.detach().cpu().float(), rewards, resp.sum(1))


def sequence_accuracy(rewards: torch.Tensor, group_size: int) -> float:
    """mean@k over prompts: the mean over prompts of each prompt's fraction of correct samples."""
    return float(rewards.view(-1, group_size).mean(1).mean())
