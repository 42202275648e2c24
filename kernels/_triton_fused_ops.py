"""Triton kernels of the fused non-GEMM ops (contract, launches and references in ``fused_ops``).

The reference's arithmetic, op for op: fp32 operations in its order, a round-to-nearest-even cast to the
activations' dtype (``round_to``) wherever it rounds, IEEE division, and CUDA's own expf / rsqrtf (libdevice,
the code torch's kernels compile to). Launched with FMA contraction off. Under the interpreter (CPU tests)
the math functions are numpy's, which is what the CPU reference computes too.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._backend import interpreter_on
from ._triton_pdl import pdl_wait
from ._triton_round import round_to
from ._triton_torch_order import add_to_accumulator, vec4_row_sum

if interpreter_on():
    @triton.jit
    def _expf(x):
        return tl.exp(x)

    @triton.jit
    def _rsqrtf(x):
        return tl.math.rsqrt(x)

    @triton.jit
    def _div(a, b):
        return a / b
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _expf(x):
        return libdevice.exp(x)

    @triton.jit
    def _rsqrtf(x):
        return libdevice.rsqrt(x)

    @triton.jit
    def _div(a, b):
        return tl.math.div_rn(a, b)


@triton.jit
def _residual_sum(xv, rv, HF: tl.constexpr):
    """residual + x: rounded to x's dtype for "hf", fp32 for "vllm"."""
    s = rv.to(tl.float32) + xv.to(tl.float32)
    if HF:
        s = round_to(s, xv.dtype)
    return s


@triton.jit
def _square_kernel(x, x_stride, res, res_stride, summed, sq, N, HAS_RES: tl.constexpr, HF: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row r: the value the norm normalises (x, or ``_residual_sum``, stored in ``summed``) and its square in
    fp32 (``sq``), for torch's mean to reduce."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    xv = tl.load(x + r * x_stride + cols, mask=m, other=0.0)
    if HAS_RES:
        s = _residual_sum(xv, tl.load(res + r * res_stride + cols, mask=m, other=0.0), HF)
        tl.store(summed + r * N + cols, s, mask=m)
        h = s.to(tl.float32)
    else:
        h = xv.to(tl.float32)
    tl.store(sq + r * N + cols, h * h, mask=m)


@triton.jit
def _row_square_sum(xrow, rrow, HAS_RES: tl.constexpr, HF: tl.constexpr, J: tl.constexpr):
    """The sum of the squares of a row of N = 128 J (x's, or ``_residual_sum``'s; ``xrow`` / ``rrow``: the rows'
    first elements, unit stride) in the order of torch's mean over rows of N (``fused_ops.row_mean_emulated``;
    the mean is this times fp32(1 / N), as its MeanOps). One warp's worth of lanes: lane l's accumulator i
    reads elements 128 j + 4 l + i."""
    lane4 = tl.arange(0, 32) * 4
    a0 = tl.zeros([32], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    for j in tl.static_range(J):
        for i in tl.static_range(4):
            c = j * 128 + lane4 + i
            xv = tl.load(xrow + c)
            if HAS_RES:
                h = _residual_sum(xv, tl.load(rrow + c), HF).to(tl.float32)
            else:
                h = xv.to(tl.float32)
            a0, a1, a2, a3 = add_to_accumulator(a0, a1, a2, a3, h * h, i)
    return vec4_row_sum(a0, a1, a2, a3)


@triton.jit
def _square_mean_kernel(x, x_stride, res, res_stride, summed, var, inv_n, HAS_RES: tl.constexpr,
                        HF: tl.constexpr, J: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``_square_kernel``'s row (N = 128 J) with its mean square written instead of the squares
    (``_row_square_sum`` times fp32(1 / N)). One warp. The residual sum is stored first, as whole-row vectors:
    a store between the loads of the accumulation would hold each later load behind it (the compiler cannot
    tell the buffers apart), one memory latency per element the lane reads. BLOCK: the power of two >= 128 J."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    if HAS_RES:
        cols = tl.arange(0, BLOCK)
        m = cols < 128 * J
        s = _residual_sum(tl.load(x + r * x_stride + cols, mask=m, other=0.0),
                          tl.load(res + r * res_stride + cols, mask=m, other=0.0), HF)
        tl.store(summed + r * (128 * J) + cols, s, mask=m)
    tl.store(var + r, _row_square_sum(x + r * x_stride, res + r * res_stride, HAS_RES, HF, J) * inv_n)


@triton.jit
def _norm_half(x, inv, w, HF: tl.constexpr):
    """A row (or half a head row)'s RMSNorm output, in the activations' dtype."""
    h = x.to(tl.float32)
    if HF:
        return round_to(w.to(tl.float32) * round_to(h * inv, w.dtype).to(tl.float32), w.dtype)
    return round_to((h * inv) * w.to(tl.float32), w.dtype)


@triton.jit
def _norm_tail_kernel(src, src_stride, var, w, y, res_out, N, eps, HF: tl.constexpr, WRITE_RES: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y = the norm of row r of ``src`` given its mean square ``var[r]``: "hf" w * (h * rsqrt(var + eps)
    rounded), rounded; "vllm" (h * rsqrt(var + eps)) * w in fp32, rounded once (and the rounded residual)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    sv = tl.load(src + r * src_stride + cols, mask=m, other=0.0)
    wv = tl.load(w + cols, mask=m, other=0.0)
    out = _norm_half(sv, _rsqrtf(tl.load(var + r) + eps), wv, HF)
    if WRITE_RES and not HF:
        tl.store(res_out + r * N + cols, round_to(sv.to(tl.float32), wv.dtype), mask=m)
    tl.store(y + r * N + cols, out, mask=m)


@triton.jit
def _qk_square_kernel(qkv, row_stride, q_sq, k_sq, NQ, NKV, D: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token i, head h over the Hq query then Hkv key heads): the fp32 squares of that head's row."""
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, D)
    x = tl.load(qkv + i * row_stride + h * D + cols).to(tl.float32)
    if h < NQ:
        tl.store(q_sq + (i * NQ + h) * D + cols, x * x)
    else:
        tl.store(k_sq + (i * NKV + (h - NQ)) * D + cols, x * x)


@triton.jit
def _head_mean_square(base, inv_d, D: tl.constexpr):
    """The mean square of the head row at ``base`` (D = 128 J) in torch's order (as ``_square_mean_kernel``):
    lane l's accumulator k adds elements 128 j + 4 l + k."""
    lane4 = tl.arange(0, 32) * 4
    a0 = tl.zeros([32], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    for j in tl.static_range(D // 128):
        x0 = tl.load(base + j * 128 + lane4).to(tl.float32)
        x1 = tl.load(base + j * 128 + lane4 + 1).to(tl.float32)
        x2 = tl.load(base + j * 128 + lane4 + 2).to(tl.float32)
        x3 = tl.load(base + j * 128 + lane4 + 3).to(tl.float32)
        a0, a1, a2, a3 = a0 + x0 * x0, a1 + x1 * x1, a2 + x2 * x2, a3 + x3 * x3
    return vec4_row_sum(a0, a1, a2, a3) * inv_d


@triton.jit
def _qk_tail_kernel(qkv, row_stride, q_var, k_var, qw, kw, cos, sin, cs_b, cs_t, q_out, k_out, k_cache, v_cache,
                    slots, pos, pos_b, pos_t, kc_s, kc_h, kc_p, T, NQ, NKV, eps, inv_d, D: tl.constexpr,
                    HALF: tl.constexpr, HF: tl.constexpr, CACHE: tl.constexpr, MEAN: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Program (token i, head h): the head's RMSNorm (q_norm / k_norm), then rotary at the token's position;
    key heads also go, with the token's value head, into the KV cache at (slot, position). The head's mean
    square: ``q_var`` / ``k_var``, or (MEAN, D = 128 J) taken here in torch's order."""
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    lo = tl.arange(0, HALF)
    base = qkv + i * row_stride + h * D
    x_lo = tl.load(base + lo)
    x_hi = tl.load(base + HALF + lo)
    is_q = h < NQ
    if MEAN:
        var = _head_mean_square(base, inv_d, D)
    elif is_q:
        var = tl.load(q_var + i * NQ + h)
    else:
        var = tl.load(k_var + i * NKV + (h - NQ))
    inv = _rsqrtf(var + eps)
    if is_q:
        w_lo = tl.load(qw + lo)
        w_hi = tl.load(qw + HALF + lo)
    else:
        w_lo = tl.load(kw + lo)
        w_hi = tl.load(kw + HALF + lo)
    n_lo = _norm_half(x_lo, inv, w_lo, HF)
    n_hi = _norm_half(x_hi, inv, w_hi, HF)
    b = i // T
    t = i - b * T
    cb = cos + b * cs_b + t * cs_t
    sb = sin + b * cs_b + t * cs_t
    c_lo = tl.load(cb + lo)
    c_hi = tl.load(cb + HALF + lo)
    s_lo = tl.load(sb + lo)
    s_hi = tl.load(sb + HALF + lo)
    a_lo = n_lo.to(tl.float32)
    a_hi = n_hi.to(tl.float32)
    if HF:  # (x * cos) + (rotate_half(x) * sin), every product and the sum rounded
        dt = n_lo.dtype
        o_lo = round_to(round_to(a_lo * c_lo.to(tl.float32), dt).to(tl.float32)
                        + round_to((-a_hi) * s_lo.to(tl.float32), dt).to(tl.float32), dt)
        o_hi = round_to(round_to(a_hi * c_hi.to(tl.float32), dt).to(tl.float32)
                        + round_to(a_lo * s_hi.to(tl.float32), dt).to(tl.float32), dt)
    else:  # fp32 x * cos + rotate_half(x) * sin, one cast
        o_lo = round_to(a_lo * c_lo + (-a_hi) * s_lo, n_lo.dtype)
        o_hi = round_to(a_hi * c_hi + a_lo * s_hi, n_lo.dtype)
    if is_q:
        ob = q_out + (i * NQ + h) * D
        tl.store(ob + lo, o_lo)
        tl.store(ob + HALF + lo, o_hi)
    else:
        hk = h - NQ
        ob = k_out + (i * NKV + hk) * D
        tl.store(ob + lo, o_lo)
        tl.store(ob + HALF + lo, o_hi)
        if CACHE:
            p = tl.load(pos + b * pos_b + t * pos_t)
            dst = tl.load(slots + b) * kc_s + hk * kc_h + p * kc_p
            tl.store(k_cache + dst + lo, o_lo)
            tl.store(k_cache + dst + HALF + lo, o_hi)
            vb = qkv + i * row_stride + (NQ + NKV + hk) * D
            tl.store(v_cache + dst + lo, tl.load(vb + lo))
            tl.store(v_cache + dst + HALF + lo, tl.load(vb + HALF + lo))


@triton.jit
def silu_mul_values(gv, uv, HF: tl.constexpr):
    """SiLU(g) * u in g's dtype (gv, uv as loaded): SiLU(g) = g / (1 + exp(-g)) in fp32 (torch's formula);
    "hf" (HF) rounds it before the product. The cast kernel's fused producer calls it too."""
    g = gv.to(tl.float32)
    s = _div(g, 1.0 + _expf(-g))
    if HF:
        s = round_to(s, gv.dtype).to(tl.float32)
    return round_to(s * uv.to(tl.float32), gv.dtype)


@triton.jit
def _silu_mul_kernel(gate, g_stride, up, u_stride, out, N, HF: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    gv = tl.load(gate + r * g_stride + cols, mask=m, other=0.0)
    uv = tl.load(up + r * u_stride + cols, mask=m, other=0.0)
    tl.store(out + r * N + cols, silu_mul_values(gv, uv, HF), mask=m)


@triton.jit
def _expert_sort_kernel(ids, perm, rows, offsets, inv, n, K, E, BLOCK_N: tl.constexpr, INV: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program e: the rows routed to expert e, in their order (a stable sort), placed after the rows of every
    smaller expert; writes offsets[e] (the last program offsets[E] = n as well), and (INV) each row's place."""
    pdl_wait(PDL)
    e = tl.program_id(0)
    before = tl.sum(tl.zeros([BLOCK_N], tl.int64), axis=0)  # rows of experts < e
    mine = before                                            # rows of expert e seen so far
    for start in range(0, n, BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        v = tl.load(ids + i, mask=i < n, other=E)
        before += tl.sum((v < e).to(tl.int64), axis=0)
    for start in range(0, n, BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        v = tl.load(ids + i, mask=i < n, other=E)
        hit = (v == e).to(tl.int64)
        pos = before + mine + tl.cumsum(hit, axis=0) - hit
        tl.store(perm + pos, i.to(tl.int64), mask=hit > 0)
        tl.store(rows + pos, (i // K).to(tl.int64), mask=hit > 0)
        if INV:
            tl.store(inv + i, pos, mask=hit > 0)
        mine += tl.sum(hit, axis=0)
    tl.store(offsets + e, before)
    if e == E - 1:
        tl.store(offsets + E, before + mine)


@triton.jit
def _weighted_scatter_kernel(y, y_stride, perm, weights, prod, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """prod[perm[r]] = y[r] * weights.flat[perm[r]], rounded once to prod's dtype."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    d = tl.load(perm + r)
    wv = tl.load(weights + d).to(tl.float32)
    yv = tl.load(y + r * y_stride + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(prod + d * N + cols, round_to(yv * wv, prod.dtype.element_ty), mask=m)


@triton.jit
def combine_values(y, y_stride, inv, weights, t, cols, m, K: tl.constexpr, HF: tl.constexpr):
    """Token t's sum over j < K of y[inv[t K + j], cols] * weights[t, j] ("hf": each product rounded to y's
    dtype; "vllm": fp32), in the order of torch's sum over dim 1 of [T, K, N] (``thread_reduce``: four
    accumulators from 0.0, accumulator i adding j = i, i + 4, .. in order, then the four in order), in fp32:
    the combine before its one rounding. ``cols`` any shape (each column's sum involves no other column)."""
    a0 = tl.zeros(cols.shape, dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    for j in tl.static_range(K):
        r = tl.load(inv + t * K + j)
        wv = tl.load(weights + t * K + j).to(tl.float32)
        yv = tl.load(y + r * y_stride + cols, mask=m, other=0.0)
        pv = yv.to(tl.float32) * wv
        if HF:
            pv = round_to(pv, yv.dtype).to(tl.float32)
        a0, a1, a2, a3 = add_to_accumulator(a0, a1, a2, a3, pv, j)
    return ((a0 + a1) + a2) + a3


@triton.jit
def _gather_combine_kernel(y, y_stride, inv, weights, out, N, K: tl.constexpr, HF: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = ``combine_values`` of token t, rounded once to out's dtype."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    tl.store(out + t * N + cols, round_to(combine_values(y, y_stride, inv, weights, t, cols, m, K, HF),
                                          out.dtype.element_ty), mask=m)


@triton.jit
def store_combined_row(x, t, y, y_stride, inv, weights, N, K: tl.constexpr, HF: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Row t of x [T, N] (contiguous) = the experts' combine of token t in x's dtype, then a barrier: the
    program's later loads of the row (in any thread) see it. How a norm takes the combine before it in its own
    pass: its loads of x stay as they were."""
    cols = tl.arange(0, BLOCK)
    m = cols < N
    tl.store(x + t * N + cols, round_to(combine_values(y, y_stride, inv, weights, t, cols, m, K, HF),
                                        x.dtype.element_ty), mask=m)
    tl.debug_barrier()


@triton.jit
def _norm_row_kernel(x, x_stride, res, res_stride, w, y, res_out, eps, inv_n, cy, cy_stride, cinv, cw,
                     HAS_RES: tl.constexpr, HF: tl.constexpr, J: tl.constexpr, BLOCK: tl.constexpr,
                     COMBINE_K: tl.constexpr, PDL: tl.constexpr = False):
    """A whole RMSNorm of row r (N = 128 J) in one pass: (COMBINE_K: x's row is first made, the experts'
    combine of ``cy`` / ``cinv`` / ``cw`` with K = COMBINE_K), the residual sum with ``res`` (stored in
    ``res_out``: rounded to x's dtype, the new residual, for either mode), the mean square in torch's order
    (``_row_square_sum``), y = the norm's output (``_norm_half``): ``_square_mean_kernel`` then
    ``_norm_tail_kernel``, bit for bit."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = 128 * J
    cols = tl.arange(0, BLOCK)
    m = cols < N
    wv = tl.load(w + cols, mask=m, other=0.0)  # the loads that do not wait for the combine: before it
    if HAS_RES:
        rv = tl.load(res + r * res_stride + cols, mask=m, other=0.0)
    if COMBINE_K != 0:
        store_combined_row(x, r, cy, cy_stride, cinv, cw, N, COMBINE_K, HF, BLOCK)
    sv = tl.load(x + r * x_stride + cols, mask=m, other=0.0)  # the row's loads in flight beside the mean's
    var = _row_square_sum(x + r * x_stride, res + r * res_stride, HAS_RES, HF, J) * inv_n
    if HAS_RES:
        sv = _residual_sum(sv, rv, HF)
        tl.store(res_out + r * N + cols, round_to(sv.to(tl.float32), wv.dtype), mask=m)
    tl.store(y + r * N + cols, _norm_half(sv, _rsqrtf(var + eps), wv, HF), mask=m)
