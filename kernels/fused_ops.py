"""The decode step's non-GEMM ops, fused into few passes, each bit for bit its op-by-op PyTorch reference.

    rms_norm(x, weight, eps, mode, residual=None, backend=None) -> y, or (y, residual + x) with a residual
    qk_norm_rope(qkv, n_q, n_kv, q_weight, k_weight, eps, cos, sin, mode, cache=None, backend=None)
        -> (q [B, Hq, T, D], k [B, Hkv, T, D]); ``cache`` = (k_cache, v_cache, slots [B], positions [B, T]):
        the rotated keys and the values are also written to k_cache / v_cache [slots, Hkv, S, D]
    silu_mul(gate, up, mode, backend=None) -> SiLU(gate) * up
    sort_by_expert(ids, num_experts, backend=None, inverse=False) -> (perm, rows, offsets[, inv]): ids [T, k]
        the experts each token is routed to; perm [T*k] torch.sort(ids.flatten(), stable=True)'s permutation,
        rows = perm // k (the token of each sorted row), offsets [E+1] (int64) the first sorted row of each
        expert, then T*k; inv [T*k]: the sorted place of each (token, k) (perm's inverse)
    combine_experts(y, perm, weights, mode, backend=None, inv=None) -> [T, H]: routed rows y [T*k, H] (sorted by
        expert; perm[i]: row i's place in (token, k) order) weighted by weights [T, k] and summed over k
    RoutedRows(y, perm, inv, weights, mode, shape): that combine not taken yet; ``rms_norm`` (and
        ``quantize.quantize_rms_norm``) accept it as x and take the combine in their own pass where they can

``mode`` is the sampler's non-GEMM numerics (minite.engines.sampler_ops): "hf" rounds to the input dtype
after every op, as transformers' modules do op by op (the aligned arm's sampler must equal its trainer, an
upstream model, bit for bit); "vllm" keeps fp32 through each fused op and rounds once.

Why the passes look as they do. A decode step at batch 64 is ~370 launches, most of them tiny element-wise
ops at 2-4 us each even inside a CUDA graph; these ops are most of them. Element-wise arithmetic can be
fused without changing a bit (the kernels do the reference's fp32 operations in its order, round where it
rounds, use IEEE division and the CUDA math library's expf / rsqrtf, and are compiled without FMA
contraction), but a reduction only in torch's own order. So an RMSNorm is one launch instead of eight or
nine where its pass can take the mean in the order of torch's mean kernel (below: rows of 128 J < 8192, every
shipped model): residual add, mean square, normalisation and weight in one pass. Other widths take three: a
pass that writes the (residual-added) input and its squares, torch's mean on them, and one pass for the rest.
The q/k norms likewise take their means in the rotary pass. The experts' combine sums over k in the order of
torch's sum; the norm after the experts takes it in its pass.

Every mean has the bits of a torch call of at least MEAN_MIN_ROWS rows (``row_mean``). torch's CUDA reduction
sums a row in an order that depends on how many rows the call has when it has fewer than 16 (its block gets wider,
``ReduceConfig.set_block_dimension``); from 16 rows on, the order is a function of the row length alone. On
an H200 (torch 2.11), a mean over 2048 fp32 squares differed in ~23% of rows between calls of 1-15 rows and
calls of 16 or more; rows of 128 or fewer did not differ. The trainer's norms see its B x T positions, at
least 16 in any real batch, so a decode step of fewer than 16 sequences (or a short prefill) must not take
its mean on its own rows: the zero rows added to reach 16 change no other row.

Means in the square pass. For rows of N = 128 J < 8192 fp32 squares that order is, per torch's source
(``input_vectorized_thread_reduce_impl``, then ``block_x_reduce``): 32 lanes, lane l keeping four sums, sum i
adding elements 4 (l + 32 j) + i in j order from 0.0; the four added in order; the lanes by a shuffle tree
with offsets 16, 8, .., 1; then times fp32(1 / N). ``row_mean_emulated`` is that order in PyTorch; on CUDA the
square pass computes it itself and writes the mean (one launch, no squares buffer, no torch mean), once the
first-use probe (``_probe.proven``) found it bitwise equal to torch's mean on this GPU; any other width, a
failed probe, or the CPU (whose torch sums in its own order) takes torch's mean as before.

Paths: ``backend`` as everywhere in minite.kernels (Triton on CUDA, the reference on CPU, the interpreter
for "triton" on CPU). The Triton path needs the weight and cache dtypes the sampler uses (weight in x's
dtype) and, for qk_norm_rope, a head dim that is a power of two; anything else takes the reference.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _backend

MODES = ("hf", "vllm")
MEAN_MIN_ROWS = 16  # rows of every mean call (module docstring)


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"non-GEMM numerics {mode!r}: expected one of {MODES}")


def row_mean(t: torch.Tensor) -> torch.Tensor:
    """t.mean(-1, keepdim=True), each row's bits those of a call of at least MEAN_MIN_ROWS rows (zero rows
    added below fewer, then dropped)."""
    n = t.shape[-1]
    rows = t.numel() // n if n else 0
    if rows >= MEAN_MIN_ROWS or rows == 0:
        return t.mean(-1, keepdim=True)
    padded = t.new_zeros(MEAN_MIN_ROWS, n)
    padded[:rows] = t.reshape(rows, n)
    return padded.mean(-1, keepdim=True)[:rows].reshape(*t.shape[:-1], 1)


MEAN_IN_PASS_MAX = 8192  # from N = 8192 torch splits a row across warps (another order)


def row_mean_emulated(t: torch.Tensor) -> torch.Tensor:
    """torch's CUDA mean of each row of fp32 t [R, N] (N = 128 J < MEAN_IN_PASS_MAX), in its order (module
    docstring), [R, 1]: bitwise ``row_mean`` on the GPU, the square pass's order anywhere."""
    r, n = t.shape
    if n % 128 or not 0 < n < MEAN_IN_PASS_MAX:
        raise ValueError(f"row length {n}: the emulated order covers multiples of 128 below {MEAN_IN_PASS_MAX}")
    chunks = t.to(torch.float32).reshape(r, n // 128, 32, 4)
    acc = torch.zeros(r, 32, 4, dtype=torch.float32, device=t.device)
    for j in range(n // 128):
        acc = acc + chunks[:, j]
    c = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    return _backend.shuffle_tree(c)[:, None] * row_mean_factor(n)


def row_mean_factor(n: int) -> float:
    """fp32(1 / n), as torch's MeanOps factor (a float quotient, not the rounding of a double one)."""
    import numpy as np

    return float(np.float32(1.0) / np.float32(n))


def square_mean(x2, res2, summed, mode) -> torch.Tensor:
    """The square pass with the mean in it (Triton; N = 128 J): var [R, 1] of x2's rows, or of res2 + x2's
    (then written to ``summed``: rounded to x's dtype for "hf", fp32 for "vllm")."""
    from ._triton_fused_ops import _square_mean_kernel

    rows, n = x2.shape
    var = torch.empty(rows, 1, device=x2.device, dtype=torch.float32)
    if rows:
        _launch(_square_mean_kernel, (rows,), x2, x2.stride(0), res2 if res2 is not None else x2,
                0 if res2 is None else res2.stride(0), summed if summed is not None else var, var, row_mean_factor(n),
                HAS_RES=res2 is not None, HF=mode == "hf", J=n // 128,
                BLOCK=_block(n), num_warps=1)
    return var


def mean_in_pass(n: int, device) -> bool:
    """Whether the square pass takes the mean itself for rows of n (CUDA, a covered width, probe passed)."""
    if device.type != "cuda" or n % 128 or not 0 < n < MEAN_IN_PASS_MAX:
        return False
    from . import _probe

    def probe():
        g = torch.Generator(device="cpu").manual_seed(n)
        x = torch.randn(256, n, generator=g) * torch.exp2(torch.randint(-8, 9, (256, 1), generator=g).float())
        x = x.to(device, torch.bfloat16)
        return torch.equal(square_mean(x, None, None, "hf"), x.float().pow(2).mean(-1, keepdim=True))
    return _probe.proven(("row_mean", n), device, probe)


def _squares_buffer(rows: int, n: int, device) -> torch.Tensor:
    """[max(rows, MEAN_MIN_ROWS), n] fp32 for a pass to write its first ``rows`` rows of squares into: its mean
    is one call of at least MEAN_MIN_ROWS rows (the rows past ``rows`` are never read back)."""
    return torch.empty(max(rows, MEAN_MIN_ROWS), n, device=device, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- references
def rms_norm_reference(x, weight, eps, mode, residual=None):
    """"hf": transformers' Qwen3MoeRMSNorm op for op (residual add in x's dtype first); "vllm": the residual
    sum, normalisation and weight multiply in fp32, one rounding (only the stored residual is rounded). The
    mean is ``row_mean``'s (as the trainer's calls of >= 16 rows take it)."""
    _check_mode(mode)
    if mode == "hf":
        r = x if residual is None else residual + x
        h = r.to(torch.float32)
        var = row_mean(h.pow(2))
        h = h * torch.rsqrt(var + eps)
        y = weight * h.to(r.dtype)
        return y if residual is None else (y, r)
    s = x.to(torch.float32) if residual is None else x.to(torch.float32) + residual.to(torch.float32)
    var = row_mean(s.pow(2))
    y = (s * torch.rsqrt(var + eps) * weight.to(torch.float32)).to(x.dtype)
    return y if residual is None else (y, s.to(x.dtype))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_reference(q, k, cos, sin, mode):
    """q [B, Hq, T, D], k [B, Hkv, T, D]. "hf": transformers' apply_rotary_pos_emb (cos/sin [B, T, D] in q's
    dtype, every product and the sum rounded); "vllm": fp32 cos/sin [B, 1, T, D], fp32 math, one cast."""
    if mode == "hf":
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * c) + (_rotate_half(q) * s), (k * c) + (_rotate_half(k) * s)

    def rot(x):
        x32 = x.to(torch.float32)
        return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)
    return rot(q), rot(k)


def qk_norm_rope_reference(qkv, n_q, n_kv, q_weight, k_weight, eps, cos, sin, mode, cache=None):
    b, t, _ = qkv.shape
    d = q_weight.shape[0]
    q, k, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q = rms_norm_reference(q.reshape(b, t, n_q, d), q_weight, eps, mode).transpose(1, 2)
    k = rms_norm_reference(k.reshape(b, t, n_kv, d), k_weight, eps, mode).transpose(1, 2)
    q, k = rope_reference(q, k, cos, sin, mode)
    if cache is not None:
        kc, vc, slots, pos = cache
        kc[slots[:, None], :, pos] = k.transpose(1, 2).to(kc.dtype)  # [B, T, Hkv, D] at (slot, position)
        vc[slots[:, None], :, pos] = v.reshape(b, t, n_kv, d).to(vc.dtype)
    return q, k


def silu_mul_reference(gate, up, mode):
    if mode == "hf":
        return torch.nn.functional.silu(gate) * up
    return (torch.nn.functional.silu(gate.to(torch.float32)) * up.to(torch.float32)).to(gate.dtype)


def sort_by_expert_reference(ids, num_experts, inverse=False):
    expert_sorted, perm = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=expert_sorted.dtype)
    out = (perm, perm // ids.shape[-1], torch.searchsorted(expert_sorted, bounds))
    if not inverse:
        return out
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return (*out, inv)


def combine_experts_reference(y, perm, weights, mode):
    t, k = weights.shape
    out = torch.empty_like(y).index_copy_(0, perm, y).view(t, k, -1)  # back to (token, k) order
    if mode == "hf":  # transformers' grouped_mm experts: product in the activations' dtype, one rounding of the sum
        return (out * weights.reshape(t, k, 1)).sum(dim=1).to(y.dtype)
    return (out.to(torch.float32) * weights.reshape(t, k, 1)).sum(dim=1).to(y.dtype)


# ------------------------------------------------------------------------------------------- dispatch
def _use_triton(backend, x: torch.Tensor) -> bool:
    return _backend.resolve(backend, x.device) == "triton"


def _launch(kernel, grid, *args, **meta):
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    kernel[grid](*args, **meta, **_backend.pdl_meta(kernel, dev),
                 enable_fp_fusion=False)  # no FMA contraction: the reference rounds each op


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def norm_rows(x, mode, residual=None):
    """(x2, res2, summed): x's rows [R, N] and the residual's with unit column stride, and the buffer their
    sum goes to (None without a residual: rounded to x's dtype for "hf", fp32 for "vllm")."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n) if x.stride(-1) == 1 else x.contiguous().view(-1, n)
    res2 = None if residual is None else residual.reshape(-1, n)
    if res2 is not None and res2.stride(-1) != 1:
        res2 = res2.contiguous()
    dtype = x.dtype if mode == "hf" else torch.float32
    summed = None if res2 is None else torch.empty(x2.shape[0], n, device=x.device, dtype=dtype)
    return x2, res2, summed


def norm_prologue(x, mode, residual=None):
    """An RMSNorm's passes up to its last (the Triton path of ``rms_norm``): (src [R, N], var [R, 1], summed):
    the rows it normalises (x's, or the residual sum written by the square pass: rounded to x's dtype for
    "hf", fp32 for "vllm"), their mean squares (torch's mean, ``row_mean``'s bits), and that sum (None
    without a residual; for "hf" it is the new residual)."""
    x2, res2, summed = norm_rows(x, mode, residual)
    n, rows, hf = x2.shape[1], x2.shape[0], mode == "hf"
    if mean_in_pass(n, x.device):
        return (x2 if summed is None else summed), square_mean(x2, res2, summed, mode), summed
    sq = _squares_buffer(rows, n, x.device)
    if rows:
        from ._triton_fused_ops import _square_kernel
        _launch(_square_kernel, (rows,), x2, x2.stride(0), res2 if res2 is not None else x2,
                0 if res2 is None else res2.stride(0), summed if summed is not None else sq, sq, n,
                HAS_RES=res2 is not None, HF=hf, BLOCK=_block(n))
    var = sq.mean(-1, keepdim=True)[:rows]  # torch's reduction, on the reference's values (>= 16 rows)
    return (x2 if summed is None else summed), var, summed


def _norm_row_warps(n: int, combine: bool) -> int:
    """Warps of the one-pass norm (``_norm_row_kernel``); the bits do not depend on them. H200, CUDA-graph
    medians of three interleaved rounds, 64 rows of 2048 with a residual: 1 / 2 / 4 / 8 warps 6.19 / 4.67 /
    3.83 / 4.62 us (the square pass and the tail it replaces: 5.46); with the experts' combine (top-8) in the
    pass 2 / 4 / 8 warps 10.63 / 6.93 / 5.99 (the combine pass and the norm: 7.33)."""
    return 8 if combine and n >= 2048 else 4


def rms_norm(x, weight, eps, mode, residual=None, backend=None):
    """See the module docstring. ``x``: a tensor, or ``RoutedRows`` (the combine taken in the norm's pass where
    the one-pass norm runs and the combine's own one-pass conditions hold; else taken first)."""
    _check_mode(mode)
    routed = isinstance(x, RoutedRows)
    ok = (_use_triton(backend, x.y if routed else x) and weight.dtype == x.dtype and x.shape[-1] == weight.shape[0]
          and (residual is None or residual.dtype == x.dtype))
    one_pass = ok and mean_in_pass(x.shape[-1], x.device)
    if routed and not (one_pass and x.mode == mode and x.fusable()):
        x, routed = x.value(), False
    if not ok:
        return rms_norm_reference(x, weight, eps, mode, residual)
    if one_pass:
        return _rms_norm_one_pass(x, weight, eps, mode, residual)
    from ._triton_fused_ops import _norm_tail_kernel

    hf = mode == "hf"
    src, var, summed = norm_prologue(x, mode, residual)
    rows, n = src.shape
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    new_res = None if residual is None else (summed if hf else torch.empty_like(x))
    if rows:
        _launch(_norm_tail_kernel, (rows,), src, src.stride(0), var, weight, y,
                new_res if new_res is not None and not hf else y, n, eps,
                HF=hf, WRITE_RES=new_res is not None and not hf, BLOCK=_block(n))
    if residual is None:
        return y
    return y, new_res.view(x.shape)


def _rms_norm_one_pass(x, weight, eps, mode, residual):
    """``rms_norm`` as one launch (``_norm_row_kernel``) where the square pass takes the mean itself: the same
    helpers, hence the same bits, as the square pass and the tail; x may be ``RoutedRows``."""
    from ._triton_fused_ops import _norm_row_kernel

    n = x.shape[-1]
    if isinstance(x, RoutedRows):  # the pass writes the combine's rows here first
        x2 = torch.empty(x.y.shape[0] // x.weights.shape[1], n, device=x.device, dtype=x.dtype)
        comb = (x.y, x.y.stride(0), x.inv, x.weights.contiguous(), x.weights.shape[1])
    else:
        x2 = x.reshape(-1, n) if x.stride(-1) == 1 else x.contiguous().view(-1, n)
        comb = (x2, 0, x2, x2, 0)
    res2 = None if residual is None else residual.reshape(-1, n)
    if res2 is not None and res2.stride(-1) != 1:
        res2 = res2.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    new_res = None if residual is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        _launch(_norm_row_kernel, (x2.shape[0],), x2, x2.stride(0), x2 if res2 is None else res2,
                0 if res2 is None else res2.stride(0), weight, y, y if new_res is None else new_res, eps,
                row_mean_factor(n), *comb[:4], HAS_RES=res2 is not None, HF=mode == "hf", J=n // 128,
                BLOCK=_block(n), COMBINE_K=comb[4], num_warps=_norm_row_warps(n, comb[4] != 0))
    return y if residual is None else (y, new_res)


def qk_norm_rope(qkv, n_q, n_kv, q_weight, k_weight, eps, cos, sin, mode, cache=None, backend=None):
    """See the module docstring. qkv [B, T, (Hq + 2 Hkv) D]: the fused projection's output."""
    _check_mode(mode)
    b, t, width = qkv.shape
    d = q_weight.shape[0]
    ok = (_use_triton(backend, qkv) and width == (n_q + 2 * n_kv) * d and qkv.stride(-1) == 1
          and q_weight.dtype == k_weight.dtype == qkv.dtype and d >= 2 and d & (d - 1) == 0  # aranges
          and (cache is None or cache[0].dtype == cache[1].dtype == qkv.dtype)
          and cos.dtype == sin.dtype == (qkv.dtype if mode == "hf" else torch.float32))
    if not ok:
        return qk_norm_rope_reference(qkv, n_q, n_kv, q_weight, k_weight, eps, cos, sin, mode, cache)
    from ._triton_fused_ops import _qk_square_kernel, _qk_tail_kernel

    dev, rows = qkv.device, b * t
    q_out = torch.empty(b, t, n_q, d, device=dev, dtype=qkv.dtype)
    k_out = torch.empty(b, t, n_kv, d, device=dev, dtype=qkv.dtype)
    if rows == 0:
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    q2 = qkv.reshape(rows, width) if qkv.is_contiguous() else qkv.contiguous().view(rows, width)
    grid = (rows, n_q + n_kv)
    in_pass = mean_in_pass(d, dev)  # the tail takes each head's mean itself
    if in_pass:
        q_var = k_var = q_out  # not read
    else:
        # q's [b, t, n_q] rows, k's [b, t, n_kv] rows, then padding: one mean call for both (of >= 16 rows,
        # where torch's order for a row depends on the row length alone, so each row's bits are those of its
        # own call)
        sq = _squares_buffer(rows * (n_q + n_kv), d, dev)
        _launch(_qk_square_kernel, grid, q2, q2.stride(0), sq[:rows * n_q], sq[rows * n_q:], n_q, n_kv, D=d,
                num_warps=4)
        var = sq.mean(-1, keepdim=True)  # torch's reduction, on the reference's values
        q_var, k_var = var[:rows * n_q], var[rows * n_q:]
    cs, sn = cos.reshape(b, t, d), sin.reshape(b, t, d)
    if cs.stride(-1) != 1 or sn.stride() != cs.stride():
        cs, sn = cs.contiguous(), sn.contiguous()
    if cache is None:
        kc = vc = k_out
        slots, pos = torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, 1, dtype=torch.int64, device=dev)
        kcs = (0, 0, 0)
        has_cache = False
    else:
        kc, vc, slots, pos = cache
        pos = pos.expand(b, t)
        if kc.stride() != vc.stride() or kc.stride(-1) != 1:
            return qk_norm_rope_reference(qkv, n_q, n_kv, q_weight, k_weight, eps, cos, sin, mode, cache)
        kcs = (kc.stride(0), kc.stride(1), kc.stride(2))
        has_cache = True
    _launch(_qk_tail_kernel, grid, q2, q2.stride(0), q_var, k_var, q_weight, k_weight, cs, sn,
            cs.stride(0), cs.stride(1), q_out, k_out, kc, vc, slots, pos, pos.stride(0), pos.stride(1),
            *kcs, t, n_q, n_kv, eps, row_mean_factor(d), D=d, HALF=d // 2, HF=mode == "hf", CACHE=has_cache,
            MEAN=in_pass,
            num_warps=1 if in_pass else 4)  # the mean's lane trees in one warp, as the square passes take them
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def silu_mul(gate, up, mode, backend=None):
    """See the module docstring. gate, up [..., I] (any row stride: the two halves of one projection)."""
    _check_mode(mode)
    if not _use_triton(backend, gate) or gate.shape != up.shape or gate.dtype != up.dtype or \
            gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_mul_reference(gate, up, mode)
    from ._triton_fused_ops import _silu_mul_kernel

    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    if g2.shape[0]:
        _launch(_silu_mul_kernel, (g2.shape[0], _cdiv(n, 1024)), g2, g2.stride(0), u2, u2.stride(0), out,
                n, HF=mode == "hf", BLOCK=1024)
    return out


def sort_by_expert(ids, num_experts, backend=None, inverse=False):
    """See the module docstring. A counting sort, one program per expert: the rows of smaller experts come
    first, then its own rows in their order (exactly a stable sort's permutation)."""
    if not _use_triton(backend, ids) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        return sort_by_expert_reference(ids, num_experts, inverse)
    from ._triton_fused_ops import _expert_sort_kernel

    n = ids.numel()
    flat = ids.reshape(-1).contiguous()
    perm = torch.empty(n, dtype=torch.int64, device=ids.device)
    rows = torch.empty(n, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=ids.device)
    inv = torch.empty(n, dtype=torch.int64, device=ids.device) if inverse else perm
    _launch(_expert_sort_kernel, (num_experts,), flat, perm, rows, offsets, inv, n, ids.shape[-1], num_experts,
            BLOCK_N=min(4096, _block(n)), INV=inverse, num_warps=4)
    return (perm, rows, offsets, inv) if inverse else (perm, rows, offsets)


def combine_experts_emulated(y, inv, weights, mode):
    """``_gather_combine_kernel``'s arithmetic in PyTorch (torch's CUDA order of the sum over k, emulated):
    bitwise ``combine_experts_reference`` on the GPU, the kernel's reference under the interpreter."""
    t, k = weights.shape
    rows = y[inv.reshape(t, k)].to(torch.float32)                     # [T, k, H]
    prod = rows * weights.to(torch.float32)[:, :, None]
    if mode == "hf":
        prod = prod.to(y.dtype).to(torch.float32)
    acc = [torch.zeros_like(prod[:, 0]) for _ in range(4)]
    for j in range(k):
        acc[j % 4] = acc[j % 4] + prod[:, j]
    return (((acc[0] + acc[1]) + acc[2]) + acc[3]).to(y.dtype)


COMBINE_MAX_K = 32  # the k whose order was derived and GPU-tested (torch splits far larger k across warps)


def _gather_combine(y, inv, weights, mode):
    """One pass (``_gather_combine_kernel``): each token's k rows read through ``inv``, weighted, summed in the
    order of torch's sum over k, rounded once."""
    from ._triton_fused_ops import _gather_combine_kernel

    t, k = weights.shape
    h = y.shape[1]
    out = torch.empty(t, h, device=y.device, dtype=y.dtype)
    if t:
        _launch(_gather_combine_kernel, (t, _cdiv(h, 1024)), y, y.stride(0), inv, weights.contiguous(), out, h,
                K=k, HF=mode == "hf", BLOCK=1024)
    return out


def combine_in_one_pass(y, weights, mode) -> bool:
    """Whether the gathered one-pass combine runs here (CUDA, k <= COMBINE_MAX_K, probe passed): its order
    is torch's sum over dim 1 as read from torch's source (``thread_reduce``), and the first-use probe checks
    it against torch on this GPU, on products of wide magnitudes and both signs (sums that cancel)."""
    t, k = weights.shape
    if y.device.type != "cuda" or k > COMBINE_MAX_K:
        return False
    from . import _probe

    def probe():
        g = torch.Generator(device="cpu").manual_seed(k)
        rows, h = 64, y.shape[1]
        scale = torch.exp2(torch.randint(-12, 13, (rows * k, h), generator=g).float())
        yy = (torch.randn(rows * k, h, generator=g) * scale).to(y.device, y.dtype)
        ids = torch.stack([torch.randperm(128, generator=g)[:k] for _ in range(rows)]).to(y.device)
        ww = torch.rand(rows, k, generator=g).to(y.device, weights.dtype)
        perm, _, _, inv = sort_by_expert_reference(ids, 128, inverse=True)
        want = combine_experts_reference(yy, perm, ww, mode)
        return torch.equal(_gather_combine(yy, inv, ww, mode).view(torch.int16), want.view(torch.int16))
    return _probe.proven(("combine", k, y.shape[1], y.dtype, weights.dtype, mode), y.device, probe)


def _combine_on_triton(y, weights, mode, backend) -> bool:
    return (_use_triton(backend, y) and y.stride(-1) == 1
            and weights.dtype in ((y.dtype,) if mode == "hf" else (y.dtype, torch.float32)))


def _gathered(y, weights, mode, inv) -> bool:
    """Whether the combine runs as one gathered pass (``_gather_combine``) on the Triton path."""
    return inv is not None and y.dtype in (torch.bfloat16, torch.float16) and combine_in_one_pass(y, weights, mode)


def combine_experts(y, perm, weights, mode, backend=None, inv=None):
    """See the module docstring. With ``inv`` (``sort_by_expert(..., inverse=True)``), on CUDA: one gathered
    pass in torch's order of the sum, once the probe has matched it to torch here; else a weighted scatter
    and torch's sum."""
    _check_mode(mode)
    if not _combine_on_triton(y, weights, mode, backend):
        return combine_experts_reference(y, perm, weights, mode)
    from ._triton_fused_ops import _weighted_scatter_kernel

    t, k = weights.shape
    s, h = y.shape
    prod_dtype = y.dtype if mode == "hf" else torch.float32
    if _gathered(y, weights, mode, inv):
        return _gather_combine(y, inv, weights, mode)
    prod = torch.empty(t, k, h, device=y.device, dtype=prod_dtype)
    if s:
        _launch(_weighted_scatter_kernel, (s, _cdiv(h, 1024)), y, y.stride(0), perm,
                weights.contiguous(), prod, h, BLOCK=1024)
    return prod.sum(dim=1).to(y.dtype)  # torch's reduction over k, as the reference's


class RoutedRows(NamedTuple):
    """The experts' outputs per routed row with their combine not taken yet: ``value()`` is ``combine_experts(y,
    perm, weights, mode, inv=inv)`` viewed as ``shape`` (in y's dtype). The norm that reads the combine
    takes it in its own pass where ``fusable`` (one launch less); every other reader asks for ``value()``."""
    y: torch.Tensor
    perm: torch.Tensor
    inv: torch.Tensor
    weights: torch.Tensor
    mode: str
    shape: tuple

    @property
    def dtype(self) -> torch.dtype:
        return self.y.dtype

    @property
    def device(self) -> torch.device:
        return self.y.device

    def value(self) -> torch.Tensor:
        return combine_experts(self.y, self.perm, self.weights, self.mode, inv=self.inv).view(self.shape)

    def reshape(self, *shape) -> RoutedRows:
        return self._replace(shape=tuple(torch.empty(self.shape, device="meta").view(*shape).shape))

    def fusable(self) -> bool:
        """Whether a pass may compute the combine as ``combine_experts`` would: its gathered one-pass path."""
        return _combine_on_triton(self.y, self.weights, self.mode, None) and _gathered(
            self.y, self.weights, self.mode, self.inv)
