"""Attention for both engines: batch-invariant attention for the aligned arm, and the sampler's decode step.

The trainer scores a whole sequence at once (queries [T], keys [T], causal mask); the sampler scores one new
token per decode step against its KV cache (queries [1], keys [p + 1]). With ordinary kernels the two take
different reduction orders (different matmul shapes, masked vs absent keys), so the same token gets
different bits. Invariant attention runs every reduction in float64 on BF16/fp32 inputs, so the rounded
output does not depend on reduction order or on how many masked keys ride along
(``minite.kernels.attention.invariant_attention_reference`` states the argument).

Where it runs: on CUDA, ``minite.kernels``: full sequences in a Triton kernel, flash style (online softmax,
no [T, T] float64 buffer); decode steps on the fp64 tensor-core CUDA kernel where it is built (else Triton),
split over the KV cache with GQA and no copy of the cache; on CPU the PyTorch reference. Kernel and reference
give the same bits, and so do the full-sequence and decode kernels at the same position: trainer log-probs ==
sampler log-probs.

It is registered in transformers' ``AttentionInterface`` as ``"minite_invariant"`` (see
``register_attention``), for the trainer without a mask function (``register_trainer_attention``), and called
directly by the sampler. Invariance is needed where log-probs are
compared — the trainer's teacher-forced recompute and every sampler forward, all without an autograd graph.
When autograd is recording (the learner update) the adapter hands over to transformers' SDPA: that path only
feeds gradients, and float64 attention there would dominate a 2048-token update.
"""
from __future__ import annotations

import torch

from minite import kernels

ATTENTION_NAME = "minite_invariant"


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        keep: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D] -> output [B, Tq, Hq, D] in query's dtype.

    Query i sits at key position Tk - Tq + i. ``causal``: it attends keys 0 .. Tk - Tq + i; ``keep``: bool mask
    broadcastable to [B, Hq, Tq, Tk] (True = attend); with both, keys allowed by both. A query with no key
    gets zeros (padding)."""
    return kernels.invariant_attention(query, key, value, scaling, keep=keep, causal=causal)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     seq_lens: torch.Tensor, scaling: float, invariant: bool, splits: int | None = None
                     ) -> torch.Tensor:
    """One decode step: q [B, Hq, D] against cache rows k/v_cache[slot_ids[b], :, :seq_lens[b]] of a
    [slots, Hkv, S, D] cache (a layer of [L, slots, Hkv, S, D]); slot_ids / seq_lens int32 [B] on the device.
    -> [B, Hq, D]. CUDA-graph safe (no host sync, fixed grid for fixed B and ``splits``). ``invariant``: the
    float64 numerics (== ``invariant_attention`` at the same position); else bf16 dots with fp32 softmax (the
    BF16 and naive arms). See ``minite.kernels.attention``."""
    return kernels.decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scaling,
                                    numerics="invariant" if invariant else "fast", splits=splits)


def _hf_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def hf_invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface adapter (same signature and return as its sdpa/eager functions)."""
    if torch.is_grad_enabled():
        return _hf_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("minite_invariant attention has no dropout (RL log-prob paths run without it)")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    keep = None
    if attention_mask is not None:
        m = attention_mask[..., : key.shape[-2]]
        keep = m if m.dtype == torch.bool else (m == 0)
    # a causal module's mask lies inside the causal triangle: saying so lets the kernel skip the keys above it
    causal = attention_mask is None or bool(getattr(module, "is_causal", False))
    return invariant_attention(query, key, value, scaling, keep=keep, causal=causal), None


def register_attention() -> str:
    """Register with transformers (idempotent); returns the name to put in config._attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, hf_invariant_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # a boolean keep-mask, as sdpa gets
    return ATTENTION_NAME


# ------------------------------------------------------------------------------------------ the trainer's
# transformers' mask creation, given no mask, looks for packed sequences in the position ids and branches on
# the answer in Python: a host sync in every forward, which drains the GPU's queue once per micro-batch of a
# learner update. The trainer's attention is therefore registered without a mask function (transformers then
# builds no mask) and the trainer passes ``causal_keep_mask`` itself when a batch is padded.
TRAINER_ATTENTION = {"sdpa": "minite_trainer_sdpa", "invariant": "minite_trainer_invariant"}


def register_trainer_attention(attention: str) -> str:
    """The trainer's attention ("sdpa": transformers' SDPA function; "invariant": ``hf_invariant_attention``)
    registered without a mask function; returns its name. The model then takes ``attention_mask=None`` (no
    padding: causal) or a 4D keep mask (``causal_keep_mask``), never a 2D one (it would be dropped)."""
    from transformers import AttentionInterface

    if attention not in TRAINER_ATTENTION:
        raise ValueError(f"trainer attention {attention!r}: expected one of {sorted(TRAINER_ATTENTION)}")
    AttentionInterface.register(TRAINER_ATTENTION[attention],
                                hf_invariant_attention if attention == "invariant" else _hf_sdpa)
    return TRAINER_ATTENTION[attention]


def causal_keep_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] padding mask (nonzero = a token) -> [B, 1, T, T] bool: query i sees key j when j <= i and key j
    is a token. The mask transformers' ``sdpa_mask`` builds for a padded batch without a cache (same values,
    same layout), made here without a read back to the host."""
    t = attention_mask.shape[1]
    pos = torch.arange(t, device=attention_mask.device)
    return (pos[None, None, None, :] <= pos[None, None, :, None]) & attention_mask.bool()[:, None, None, :]
