"""Batch-invariant attention, shared by both engines in the aligned arm.

The trainer scores a whole sequence at once (queries [T], keys [T], causal mask); the sampler scores one new
token per decode step against its KV cache (queries [1], keys [p + 1]). With ordinary kernels the two take
different reduction orders (different matmul shapes, masked vs absent keys), so the same token gets
different bits. Here every reduction runs in float64 on BF16/fp32 inputs: q.k products of BF16 values are
exact in float64 and their sums are exact for any realistic range, and the softmax / PV sums carry ~30 more
bits than the fp32/BF16 result keeps, so the rounded output does not depend on reduction order or on how
many masked keys ride along (a difference needs a float64 result within 2**-53 of a rounding boundary).

It is registered in transformers' ``AttentionInterface`` as ``"minite_invariant"`` (see
``register_attention``) and called directly by the sampler's decode loop. Invariance is needed where
log-probs are compared — the trainer's teacher-forced recompute and every sampler forward, all without an
autograd graph. When autograd is recording (the learner update) the adapter hands over to transformers' SDPA:
that path only feeds gradients, and float64 attention there would dominate a 2048-token update.
"""
from __future__ import annotations

import torch

ATTENTION_NAME = "minite_invariant"


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        keep: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D] -> output [B, Tq, Hq, D] in query's dtype.

    ``keep``: bool mask broadcastable to [B, Hq, Tq, Tk] (True = attend). Without it and with ``causal``,
    query i (the last Tq positions of the Tk keys) attends to keys 0 .. Tk - Tq + i.
    """
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of key/value heads {hkv}")
    rep = hq // hkv
    q = query.to(torch.float64)
    k = key.to(torch.float64).repeat_interleave(rep, dim=1)
    v = value.to(torch.float64).repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if keep is None and causal:
        i = torch.arange(tq, device=query.device)[:, None] + (tk - tq)
        keep = torch.arange(tk, device=query.device)[None, :] <= i
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked rows (padding queries) -> zeros, not NaN
    out = torch.matmul(probs, v)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def hf_invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface adapter (same signature and return as its sdpa/eager functions)."""
    if torch.is_grad_enabled():
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("minite_invariant attention has no dropout (RL log-prob paths run without it)")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    keep = None
    if attention_mask is not None:
        m = attention_mask[..., : key.shape[-2]]
        keep = m if m.dtype == torch.bool else (m == 0)
    return invariant_attention(query, key, value, scaling, keep=keep, causal=attention_mask is None), None


def register_attention() -> str:
    """Register with transformers (idempotent); returns the name to put in config._attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, hf_invariant_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # a boolean keep-mask, as sdpa gets
    return ATTENTION_NAME
