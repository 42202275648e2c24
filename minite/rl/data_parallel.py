"""Data-parallel rollouts and scoring under torchrun: one sampler replica per rank, the step's rows split.

The P x G rows of a step (each prompt G times, groups contiguous) are split into equal contiguous shares, one
per rank (``minite.distributed.row_share``). Each rank's sampler answers its rows with its own generator; the
rollouts are gathered (``all_gather_object``, padded to the longest) so that every rank holds the whole step:
advantages, metrics and the step's log line come out the same everywhere, and rank 0 writes them. The trainer's
log-probs are computed the same way (each rank scores its rows, then all-gather), and each rank trains on its
own rows (``local_rows``), the loss normalised over the whole batch by the trainer.

With one process every function here is the single-process code path, unchanged.
"""
from __future__ import annotations

import torch

from minite import distributed as D
from minite.rl.rollout import Rollout, rollout


def rollout_rows(task, sampler, problems, group_size: int, **kw) -> Rollout:
    """``rollout`` of every problem ``group_size`` times, each rank sampling its share of the rows."""
    if D.world_size() == 1:
        return rollout(task, sampler, problems, group_size, **kw)
    rows = D.row_share(len(problems) * group_size, "rollout rows (prompts x group size)")
    mine = [problems[i // group_size] for i in range(rows.start, rows.stop)]
    return gather_rollout(rollout(task, sampler, mine, 1, **kw))


def gather_rollout(local: Rollout) -> Rollout:
    """Every rank's rollout rows in rank order, padded (PAD = 0, masks 0) to the longest sequence."""
    parts = D.all_gather_object(local)
    length = max(p.tokens.shape[1] for p in parts)

    def cat(field: str) -> torch.Tensor:
        ts = [getattr(p, field) for p in parts]
        if ts[0].dim() == 2:
            ts = [torch.nn.functional.pad(t, (0, length - t.shape[1])) for t in ts]
        return torch.cat(ts)

    return Rollout(*(cat(f) for f in ("tokens", "attention_mask", "response_mask", "sampler_logprobs", "rewards",
                                      "response_lens")))


def logprobs(trainer, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``trainer.logprobs`` of the whole batch (CPU fp32), each rank scoring its rows."""
    if D.world_size() == 1:
        return trainer.logprobs(tokens, attention_mask).detach().float().cpu()
    rows = D.row_share(tokens.shape[0])
    return D.all_gather_rows(trainer.logprobs(tokens[rows], attention_mask[rows]).detach().float().cpu())


def local_rows(batch: dict, n: int) -> dict:
    """This rank's rows of a batch of ``n`` rows (per-row tensors sliced, everything else as it is)."""
    if D.world_size() == 1:
        return batch
    rows = D.row_share(n)
    return {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
            for k, v in batch.items()}
