"""Attention for the sampler's decode step and the trainer's log-prob recompute, each beside its PyTorch reference.

    decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scaling, numerics="fast", splits=None,
                     backend=None, check_values=True, head_groups=None) -> [B, Hq, D]
        One new token per sequence against its cache row. q [B, Hq, D]; k_cache / v_cache [slots, Hkv, S, D]
        (the per-layer view cache[l] of a [L, slots, Hkv, S, D] cache is fine: any strides, last dim
        contiguous); slot_ids [B] int32 (the cache row of each sequence) and seq_lens [B] int32 (keys
        0 .. len - 1 valid, 1 <= len <= S), both on the device and read only there: no host sync, a grid
        fixed per batch size ((B, Hkv, splits); (B, Hkv x head groups, splits) for the float64 Triton kernel),
        so a CUDA graph can capture it and replay it with new ids / lengths. A padding row (slot of a dummy
        cache row, len 1) computes harmlessly. GQA without a repeat_interleave copy: a program loads its KV head
        once for the query heads it takes (all Hq / Hkv, or a 1 / ``head_groups`` share in float64). Values
        outside those ranges are undefined on the GPU.
        numerics "fast": bf16 dots, fp32 softmax/accumulators (what SDPA does); bits depend on ``splits``.
        numerics "invariant": float64 throughout, bitwise equal to ``invariant_attention_reference`` and
        to ``invariant_attention`` at the same positions, whatever ``splits``. On CUDA: the fp64 tensor-core
        kernel (``_cuda_attention``) where it is built and takes the operands (BF16, head dim 64 / 128,
        16-byte aligned rows) and no Triton knob (``head_groups``, backend="triton") is given; else Triton.
    invariant_attention(query, key, value, scaling, keep=None, causal=True, backend=None) -> [B, Tq, Hq, D]
        Full-sequence float64 attention, flash style (online softmax, no [Tq, Tk] buffer), bitwise equal to
        ``invariant_attention_reference``.
backend: None / "auto" (Triton for CUDA tensors, PyTorch for CPU ones), "triton" (CPU under
TRITON_INTERPRET=1), "torch" (the references).
"""
from __future__ import annotations

import struct

import torch
import torch.nn.functional as F

from . import _backend

NUMERICS = ("fast", "invariant")
MAX_SPLITS = 64
# fp64 kernels: BN keys per block (BN * 8 bytes of p per row in scratch), BD = 8 bf16 = one 16-byte load per
# thread and key; rows: the GQA group (decode) or BM query positions (prefill). One warp holds up to 8 rows
# (sm_90 ptxas: 230-246 registers, no spills); 16 rows need two warps. Decode takes two warps for a large
# p.v accumulator too (``_f64_decode_warps``).
F64_BN, F64_BD, PREFILL_BM = 64, 8, 8


def f64_qk_stages(rows: int) -> int:
    """Software-pipeline stages of the fp64 kernels' q.k loop: three for up to 8 rows (H200, CUDA-graph
    medians, the bits the same: decode 8 rows x 128 at 96 keys 25.3 -> 23.7 us, at 1024 keys 321 -> 180;
    prefill 512 x 512 650 -> 601 us; a pipelined p.v loop was slower), none for 16 (sm_90 spills)."""
    return 3 if rows <= 8 else 1


#: the fp64 kernels' p.v loop, per kernel: (keys per round, every round masked). The loads of a round are
#: issued together; the sum stays key after key, so the bits do not depend on either. H200, CUDA-graph
#: medians (two interleaved rounds, every variant bitwise the reference): decode 8 rows x 128 at batch 64
#: and 96 keys 23.8 us rolled -> 20.9 with masked rounds of 8 (unmasked rounds of 4: 22.9, of 8: 30.2), at
#: 1024 keys 180 -> 154; prefill B2 x 512 606 -> 477-486 with unmasked rounds of 4 (masked rounds of 8: 516)
F64_PV = {"decode": (8, True), "prefill": (4, False)}
FAST_BN = 64


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _f64_bits(x: float) -> int:
    """The int64 bit pattern of float64(x): how the fp64 kernels receive the softmax scale exactly."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# ---------------------------------------------------------------------------------------------- references
def invariant_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                                  keep: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D] -> [B, Tq, Hq, D] in query's dtype; every reduction in
    float64. Query i (at key position Tk - Tq + i) attends keys 0 .. Tk - Tq + i when ``causal``, and only
    keys where ``keep`` (bool, broadcastable to [B, Hq, Tq, Tk]) is True when given; both when both.

    Why the bits do not depend on reduction order: q.k products of BF16 values are exact in float64 and
    their sums are exact for any realistic range, and the softmax / PV sums carry ~30 more bits than the
    fp32/BF16 result keeps, so the rounded output does not depend on reduction order or on how many masked
    keys ride along (a difference needs a float64 result within 2**-53 of a rounding boundary)."""
    hq, tq = query.shape[1], query.shape[2]
    hkv, tk = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of key/value heads {hkv}")
    rep = hq // hkv
    q = query.to(torch.float64)
    k = key.to(torch.float64).repeat_interleave(rep, dim=1)
    v = value.to(torch.float64).repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    mask = keep
    if causal:
        i = torch.arange(tq, device=query.device)[:, None] + (tk - tq)
        tri = torch.arange(tk, device=query.device)[None, :] <= i
        mask = tri if mask is None else (mask & tri)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked rows (padding queries) -> zeros, not NaN
    out = torch.matmul(probs, v)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def decode_attention_reference(q, k_cache, v_cache, slot_ids, seq_lens, scaling: float, numerics: str = "fast"):
    """The decode step in PyTorch: gather the cache rows, mask keys >= len. "fast": SDPA with GQA on the
    masked rows (fp32 softmax inside); "invariant": ``invariant_attention_reference``."""
    slots = slot_ids.long()
    keys, vals = k_cache[slots], v_cache[slots]                        # [B, Hkv, S, D]
    keep = torch.arange(keys.shape[2], device=q.device)[None, :] < seq_lens.long()[:, None]
    keep = keep[:, None, None, :]                                      # [B, 1, 1, S]
    if numerics == "invariant":
        return invariant_attention_reference(q[:, :, None], keys, vals, scaling, keep=keep, causal=False)[:, 0]
    out = F.scaled_dot_product_attention(q[:, :, None].to(keys.dtype), keys, vals, attn_mask=keep, scale=scaling,
                                         enable_gqa=True)
    return out[:, :, 0].to(q.dtype)


# ---------------------------------------------------------------------------------------------- checks
def _check_decode(q, k_cache, v_cache, slot_ids, seq_lens, numerics, check_values=True):
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [B, Hq, D] and k/v caches [slots, Hkv, S, D] of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"head dim {d} vs cache {k_cache.shape[3]}, or query heads {hq} not a multiple of "
                         f"KV heads {hkv}")
    for name, t in (("slot_ids", slot_ids), ("seq_lens", seq_lens)):
        if t.dim() != 1 or t.shape[0] != b or t.dtype != torch.int32:
            raise ValueError(f"{name} must be an int32 [B={b}] tensor, got {t.dtype} {tuple(t.shape)}")
    if len({q.device, k_cache.device, v_cache.device, slot_ids.device, seq_lens.device}) != 1:
        raise ValueError("q, caches, slot_ids and seq_lens must be on one device")
    # cheap on CPU (callers whose step must read nothing back pass check_values=False); never on the GPU,
    # where it would be a host sync inside the step
    if check_values and q.device.type == "cpu" and b and (
            int(seq_lens.min()) < 1 or int(seq_lens.max()) > k_cache.shape[2]
            or int(slot_ids.min()) < 0 or int(slot_ids.max()) >= k_cache.shape[0]):
        raise ValueError(f"seq_lens must be in [1, {k_cache.shape[2]}] and slot_ids in [0, {k_cache.shape[0]})")


def _kernel_head_dim(d: int) -> bool:
    return 16 <= d <= 256 and d & (d - 1) == 0


def _f64_decode_warps(rows: int, d: int) -> int:
    """Warps of a float64 decode program: two once its (rows x D) p.v accumulator is large enough to keep
    two warps fed, else one. H200, CUDA-graph medians, the bits the same either way: Qwen3-30B-A3B's 8 rows x
    128 dims at batch 64 and 96 keys 27.6 us with two warps (one: 44); the ``small`` model's 4 x 64 at batch
    256 and 160 keys 40.7 us with one (two: 66.8)."""
    return 2 if rows >= 16 or rows * d >= 1024 else 1


def f64_head_groups(batch: int, kv_heads: int, rep: int, device: torch.device) -> int:
    """Programs per KV head in the float64 decode, each taking rep / groups of its query heads: the fewest
    (a power of two, at most rep) that give two programs per SM before KV splits. A function of shapes only.
    H200, CUDA-graph medians of three interleaved rounds, every variant bitwise equal (us, one group -> this
    rule; warps by ``_f64_decode_warps``, default splits): Qwen3-30B-A3B's 8 x 128 rows at batch 64 and 66-96
    keys 23.4 -> 21.1 (2 groups), 290-320 keys 61.4 -> 53.9, 994-1024 keys 155.4 -> 138.4; at batch 8 and
    66-96 keys 21.5 -> 19.2 (8 groups); the ``small`` model's 4 x 64 at batch 256 keeps one group (32.8 us;
    two: 48.6)."""
    groups = 1
    while groups < rep and batch * kv_heads * groups < 2 * _sm_count(device):
        groups *= 2
    return min(groups, rep)


def default_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """KV splits per sequence: enough programs for ~4 per SM, at most max_len / 128 (two 64-key blocks a split)
    rounded up to a power of two, and MAX_SPLITS.
    A function of shapes only (fixed per captured batch size)."""
    want = -(-4 * _sm_count(device) // max(1, batch * kv_heads))
    return max(1, min(_pow2(want), MAX_SPLITS, _pow2(max(1, max_len // (2 * F64_BN)))))


# ---------------------------------------------------------------------------------------------- decode
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     seq_lens: torch.Tensor, scaling: float, numerics: str = "fast", splits: int | None = None,
                     backend: str | None = None, check_values: bool = True, head_groups: int | None = None
                     ) -> torch.Tensor:
    """See the module docstring. Returns [B, Hq, D] in q's dtype. ``check_values``: range-check slot_ids /
    seq_lens on CPU (a read back to the host; the GPU path never does). ``head_groups`` (float64 only):
    programs per KV head, each taking its share of the query heads (None: ``f64_head_groups``)."""
    _check_decode(q, k_cache, v_cache, slot_ids, seq_lens, numerics, check_values)
    b, hq, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    if _backend.resolve(backend, q.device) == "torch":
        return decode_attention_reference(q, k_cache, v_cache, slot_ids, seq_lens, scaling, numerics)
    if not _kernel_head_dim(d):
        raise ValueError(f"decode_attention kernel: head dim {d} must be a power of two in [16, 256]")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("decode_attention: the head dim of q and of the caches must be contiguous")
    if splits is not None and not 1 <= int(splits) <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    from . import _triton_attention as ta
    rep = hq // hkv
    f64 = numerics == "invariant"
    cuda = None  # the fp64 tensor-core kernel: "invariant" on CUDA, unless a Triton knob or backend is asked for
    if f64 and head_groups is None and (backend or "auto") == "auto":
        from . import _cuda_attention as ca
        cuda = ca.module_for(q.device) if ca.supports(q, k_cache, v_cache) else None
    if cuda is not None:
        splits, warps = ca.config(b, hkv, rep, s_max, _sm_count(q.device), int(splits) if splits else None)
    else:
        splits = int(splits) if splits else default_splits(b, hkv, s_max, q.device)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    acc_dtype = torch.float64 if f64 else torch.float32
    part_acc = torch.empty(b * hq * splits * d if splits > 1 else 1, dtype=acc_dtype, device=q.device)
    part_ml = torch.empty(b * hq * splits * 2 if splits > 1 else 1, dtype=acc_dtype, device=q.device)
    grid = (b, hkv, splits)
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3])
    if cuda is not None:
        ca.launch(cuda, q, k_cache, v_cache, slot_ids, seq_lens, part_acc, part_ml, out, scaling, splits, warps)
    elif f64:
        groups = int(head_groups) if head_groups else f64_head_groups(b, hkv, rep, q.device)
        if not 1 <= groups <= rep:
            raise ValueError(f"head_groups must be in [1, {rep}] (query heads per KV head), got {groups}")
        rows = -(-rep // groups)
        groups = -(-rep // rows)  # no empty group
        bh = _pow2(rows)
        grid = (b, hkv * groups, splits)
        scratch = torch.empty(b * hkv * groups * splits * (bh * d + F64_BN * bh), dtype=torch.float64,
                              device=q.device)
        unroll, masked = F64_PV["decode"]
        ta.decode_f64_kernel[grid](q, k_cache, v_cache, slot_ids, seq_lens, part_acc, part_ml, scratch, out,
                                   hq, rep, groups, rows, *strides, _f64_bits(scaling), D=d, BH=bh, BN=F64_BN,
                                   BD=F64_BD,
                                   DIRECT=splits == 1, QK_STAGES=f64_qk_stages(bh), PV_UNROLL=unroll,
                                   PV_MASKED=masked,
                                   num_warps=_f64_decode_warps(bh, d), num_stages=1,
                                   **_backend.pdl_meta(ta.decode_f64_kernel, q.device))
    else:
        qc = q.to(k_cache.dtype)
        ta.decode_fast_kernel[grid](qc, k_cache, v_cache, slot_ids, seq_lens, part_acc, part_ml, out,
                                    hq, rep, *qc.stride()[:2], *strides[2:], scaling * 1.4426950408889634,
                                    D=d, BH=max(16, _pow2(rep)), BN=FAST_BN, DIRECT=splits == 1,
                                    UPCAST_DOT=_backend.interpreter_on(), num_warps=2 if d <= 64 else 4,
                                    num_stages=2, **_backend.pdl_meta(ta.decode_fast_kernel, q.device))
        # H200, CUDA-graph medians: the small model's D = 64 at batch 256 and 96-288 keys 9.0-23.7 us with two
        # warps (four: 11.0-27.0); Qwen3-30B-A3B's D = 128 at batch 64 best with four
    if splits > 1:
        ta.merge_splits_kernel[(b, hq)](part_acc, part_ml, out, hq, splits, D=d, SPLITS_P2=_pow2(splits), F64=f64,
                                        num_warps=1 if d <= 64 else 2,
                                        **_backend.pdl_meta(ta.merge_splits_kernel, q.device))
    return out


# ---------------------------------------------------------------------------------------------- prefill
def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        keep: torch.Tensor | None = None, causal: bool = True, backend: str | None = None
                        ) -> torch.Tensor:
    """``invariant_attention_reference`` (same arguments, same bits) as a Triton kernel on CUDA. Head dims
    that are not a power of two in [16, 256] run the reference."""
    b, hq, tq, d = query.shape
    if key.dim() != 4 or value.shape != key.shape or key.shape[0] != b or key.shape[3] != d:
        raise ValueError(f"expected key/value [B, Hkv, Tk, D] matching query {tuple(query.shape)}; got "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    hkv, tk = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of key/value heads {hkv}")
    if keep is not None and keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool mask, got {keep.dtype}")
    if _backend.resolve(backend, query.device) == "torch" or not _kernel_head_dim(d):
        return invariant_attention_reference(query, key, value, scaling, keep=keep, causal=causal)
    from . import _triton_attention as ta
    out = torch.empty(b, tq, hq, d, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    if keep is not None:
        keep = keep.expand(b, hq, tq, tk).view(torch.uint8)  # broadcast dims get stride 0
        keep_arg, keep_strides = keep, keep.stride()
    else:
        keep_arg, keep_strides = out, (0, 0, 0, 0)
    n_tiles = b * hq * -(-tq // PREFILL_BM)
    n_prog = min(n_tiles, 8 * _sm_count(query.device))
    scratch = torch.empty(n_prog * (PREFILL_BM * d + F64_BN * PREFILL_BM), dtype=torch.float64,
                          device=query.device)
    ta.prefill_f64_kernel[(n_prog,)](
        query, key, value, keep_arg, scratch, out, hq, hq // hkv, tq, tk, n_tiles,
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *keep_strides,
        out.stride(0), out.stride(1), out.stride(2), _f64_bits(scaling),
        D=d, BM=PREFILL_BM, BN=F64_BN, BD=F64_BD, CAUSAL=bool(causal), HAS_KEEP=keep is not None,
        QK_STAGES=f64_qk_stages(PREFILL_BM), PV_UNROLL=F64_PV["prefill"][0], PV_MASKED=F64_PV["prefill"][1],
        num_warps=1, num_stages=1)
    return out
