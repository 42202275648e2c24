"""GRPO: group-relative advantages and the clipped-ratio policy loss, as in the literature.

Advantages (DeepSeekMath, Shao et al. 2024, "outcome supervision"): for each prompt the sampler draws a
group of G responses with scalar rewards r_1..r_G; every token of response i gets

    A_i = (r_i - mean(r)) / (std(r) + eps)          std = unbiased sample std (torch.std, as TRL and verl)

``std_normalize=False`` drops the division (Dr. GRPO, Liu et al. 2025: A_i = r_i - mean(r)). A group whose
rewards are all equal has A = 0 and contributes no policy gradient (DAPO filters such groups; we keep them
so the batch size is fixed and report their fraction).

Policy loss per response token t (PPO clipping with DAPO's decoupled "clip-higher" bounds, Yu et al. 2025):

    ratio_t = exp(logp_new_t - logp_old_t)
    L_t     = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A) * w_t  +  beta * k3_t

* ``logp_old`` is the TRAINER's own recompute of the sampled tokens before the update (``trainer.logprobs``),
  not the sampler's log-probs: no importance-sampling correction for the trainer/sampler mismatch (the
  point of the benchmark is to see that drift). With one update per batch ratio == 1 in value; the clip
  only matters for the gradient if the train-mode forward differs from the eval-mode recompute.
* ``w_t = 1`` by default. ``tis_cap=C`` turns on truncated importance sampling (Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"; verl ``rollout_is``):
  w_t = min(exp(logp_old_t - logp_sampler_t), C), detached.
* ``beta * k3``: optional KL to a frozen reference (DeepSeekMath eq. 4, Schulman's k3 estimator
  k3 = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1 >= 0); ``beta = 0`` by default (DAPO, Dr. GRPO).

Aggregation: ``agg="token-mean"`` (default, DAPO): sum of L_t over every response token of the batch divided
by the number of response tokens N, so long responses weigh per token, not per sequence.
``agg="seq-mean-token-mean"`` (the original GRPO objective): mean over each response's tokens, then mean over
the S responses. Both fit the trainer's loss contract (``Trainer.update``: a slice returns the SUM of its
per-token losses, the trainer divides by the whole batch's N): token-mean returns sum_t L_t as is; seq-mean
weights each token of response i by N / (S * n_i) (n_i its response tokens), so that sum / N is the mean over
responses of their token means. N and S come from the trainer (``_n_tokens``, ``_n_sequences``: the whole
batch's counts), so micro-batching never changes the objective
(tests/test_rl_loop.py::test_micro_batching_gives_the_full_batch_token_mean).

Alignment: the trainer's ``logprobs`` are [B, T-1] for tokens 1..T-1; ``loss_mask`` is [B, T] on token
positions, so the mask for the log-probs is ``loss_mask[:, 1:]``. All other per-token tensors in the batch
(``old_logprobs``, ``sampler_logprobs``, ``ref_logprobs``) are [B, T-1] like the trainer's.
"""
from __future__ import annotations

import functools
import math

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [n_prompts, G] -> advantages [n_prompts, G] (see module docstring)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 2 or r.shape[1] < 2:
        raise ValueError(f"rewards must be [n_prompts, G] with G >= 2, got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN/Inf")
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.to(torch.float32)


def token_loss_sum(logprobs: torch.Tensor, batch: dict, *, clip_low: float = 0.2, clip_high: float = 0.2,
                   beta: float = 0.0, tis_cap: float | None = None, agg: str = "token-mean") -> torch.Tensor:
    """The GRPO loss of one micro-batch slice under the trainer's contract: the sum of its per-token losses
    (weighted per response for seq-mean, module docstring). ``logprobs`` [B, T-1] with grad; batch keys:
    ``loss_mask`` [B, T], ``old_logprobs`` [B, T-1], ``advantages`` [B]; ``sampler_logprobs`` [B, T-1] when
    tis_cap is set; ``ref_logprobs`` [B, T-1] when beta > 0; ``_n_tokens`` and ``_n_sequences`` (the whole
    batch's counts, set by ``Trainer.update``) for seq-mean."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose from {AGGREGATIONS}")
    mask = batch["loss_mask"][:, 1:].to(logprobs.dtype)
    if mask.shape != logprobs.shape:
        raise ValueError(f"loss_mask[:, 1:] {tuple(mask.shape)} does not match logprobs {tuple(logprobs.shape)}")
    old = batch["old_logprobs"].to(logprobs)
    adv = batch["advantages"].to(logprobs).reshape(-1, 1)

    log_ratio = (logprobs - old) * mask                    # masked first: padding never reaches exp()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_tok = -torch.minimum(unclipped, clipped)

    if tis_cap is not None:
        per_tok = per_tok * tis_weights(old, batch["sampler_logprobs"].to(logprobs), tis_cap)
    if beta:
        d = (batch["ref_logprobs"].to(logprobs) - logprobs) * mask
        per_tok = per_tok + beta * (torch.exp(d) - d - 1.0)

    per_tok = per_tok * mask
    if agg == "token-mean":
        return per_tok.sum()
    per_seq = per_tok.sum(1) / mask.sum(1).clamp_min(1.0)
    return per_seq.sum() * (batch["_n_tokens"] / batch["_n_sequences"])


def grpo_loss(logprobs: torch.Tensor, batch: dict, **hyper) -> torch.Tensor:
    """The GRPO objective of a whole batch (``token_loss_sum`` over it / its loss tokens): the number the
    trainer's update reports for that batch."""
    n_tokens = float(batch["loss_mask"][:, 1:].sum().clamp_min(1))
    counts = {"_n_tokens": n_tokens, "_n_sequences": logprobs.shape[0]}
    return token_loss_sum(logprobs, {**batch, **counts}, **hyper) / n_tokens


def tis_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated IS weights min(exp(logp_old_trainer - logp_sampler), cap), detached (no gradient)."""
    if not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"tis_cap must be a positive finite number, got {cap!r}")
    d = (old_logprobs - sampler_logprobs).detach().clamp(max=math.log(cap))
    return torch.exp(d)


def make_loss_fn(clip_low: float = 0.2, clip_high: float = 0.2, beta: float = 0.0,
                 tis_cap: float | None = None, agg: str = "token-mean"):
    """``loss_fn(logprobs, batch_slice)`` for ``Trainer.update`` (``token_loss_sum``, hyper-parameters bound)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose from {AGGREGATIONS}")
    if tis_cap is not None:
        tis_weights(torch.zeros(1), torch.zeros(1), tis_cap)  # validate early
    return functools.partial(token_loss_sum, clip_low=clip_low, clip_high=clip_high, beta=beta,
                             tis_cap=tis_cap, agg=agg)
