"""Rollouts: the sampler answers each prompt a group of times; the task scores every answer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minite.tokenizer import EOS


@dataclass
class Rollout:
    tokens: torch.Tensor            # [B, L] long
    attention_mask: torch.Tensor    # [B, L] 1 on prompt + response tokens
    response_mask: torch.Tensor     # [B, L] 1 on generated tokens (incl. the stop token)
    sampler_logprobs: torch.Tensor  # [B, L] fp32, 0 off the response
    rewards: torch.Tensor           # [B] fp32
    response_lens: torch.Tensor     # [B] long


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
