"""EXPERIMENTAL (opt-in, not yet timed on a GPU): the decode loop with 32-bit word loads.

Run 3 (docs/KERNELS_NOTES.md) found the in-loop decode of ``_triton_gemm`` 8x slower than predicted: its
codes come through a 3D uint8 pointer tensor with one byte per thread per load, so there are no vector loads
and no cp.async pipelining. Here the codes are read as int32 words ([R, BK/8] per K step: 16-byte vector
loads that can pipeline), and each thread decodes the 8 nibbles of its own words: the 4 low nibbles are the
step's even-K values, the 4 high nibbles its odd-K values, rejoined in register order with ``tl.join``. The
values and the K order are the same as ``_triton_gemm`` (the interpreter tests check bit equality), so the
batch-invariance contract is unchanged. Selected only through ``config={"variant": "decode32", ...}`` until
a GPU run has timed it and proven it bit-equal there (the first-use probe does the latter automatically).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nib(wd, shift: tl.constexpr, sf):
    """fp16 (e2m1 * 2**-14) * scale for the nibble at ``shift`` of each int32 word."""
    c = wd >> shift
    bits = ((c & 0x7) << 9) | ((c & 0x8) << 12)
    return (bits.to(tl.uint16).to(tl.float16, bitcast=True) * sf).to(tl.float16)


@triton.jit
def _decode_words(w_ptrs, s_ptrs, mask):
    """[R, BK/8] int32 words + their scales (one per 2 words) -> (evens, odds) fp16 [R, BK/2]."""
    wd = tl.load(w_ptrs, mask=mask, other=0)
    s = tl.load(s_ptrs, mask=mask, other=0).to(tl.int32)
    sf = ((s << 7).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)
    # byte b of word w holds elements 8w+2b (low nibble) and 8w+2b+1 (high nibble);
    # join(join(x0, x2), join(x1, x3)) lays x0..x3 out in order along a new minor axis of size 4
    ev = tl.join(tl.join(_nib(wd, 0, sf), _nib(wd, 16, sf)), tl.join(_nib(wd, 8, sf), _nib(wd, 24, sf)))
    od = tl.join(tl.join(_nib(wd, 4, sf), _nib(wd, 20, sf)), tl.join(_nib(wd, 12, sf), _nib(wd, 28, sf)))
    return (tl.reshape(ev, (ev.shape[0], ev.shape[1] * 4)),
            tl.reshape(od, (od.shape[0], od.shape[1] * 4)))


@triton.jit
def nvfp4_mm_w32_kernel(a_words, a_scales, w_words, w_scales, ga_ptr, gw_ptr, bias_ptr, out_ptr,
                        tile_expert_ptr, tile_row_ptr, offsets_ptr,
                        M, N, K, n_tiles_m,
                        w_estride_c, w_estride_s, gw_estride,
                        GA_ROW: tl.constexpr, GW_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr):
    kw = K // 8   # int32 words per row
    ks = K // 16
    if GROUPED:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(offsets_ptr + e + 1)
        w_words += e.to(tl.int64) * (w_estride_c // 4)
        w_scales += e.to(tl.int64) * w_estride_s
        gw_ptr += e.to(tl.int64) * gw_estride
    else:
        pid = tl.program_id(0)
        n_tiles_n = tl.cdiv(N, BN)
        width = GROUP_M * n_tiles_n
        first_m = (pid // width) * GROUP_M
        gsize = tl.minimum(n_tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        row0 = pid_m * BM
        row_end = M
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < row_end
    nmask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    wi = tl.arange(0, BK // 8)
    a_w = a_words + rows64[:, None] * kw + wi[None, :]
    w_w = w_words + cols64[:, None] * kw + wi[None, :]
    a_s = a_scales + rows64[:, None] * ks + (wi // 2)[None, :]
    w_s = w_scales + cols64[:, None] * ks + (wi // 2)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 // 8 + wi) < kw
        a_lo, a_hi = _decode_words(a_w + k0 // 8, a_s + k0 // 16, rmask[:, None] & kmask[None, :])
        w_lo, w_hi = _decode_words(w_w + k0 // 8, w_s + k0 // 16, nmask[:, None] & kmask[None, :])
        acc = tl.dot(a_lo, tl.trans(w_lo), acc)
        acc = tl.dot(a_hi, tl.trans(w_hi), acc)
    out = acc * 268435456.0  # 2**28: the two 2**-14 decode factors
    if GA_ROW:
        out = out * tl.load(ga_ptr + rows, mask=rmask, other=0.0)[:, None]
    else:
        out = out * tl.load(ga_ptr)
    if GW_ROW:
        out = out * tl.load(gw_ptr + cols, mask=nmask, other=0.0)[None, :]
    else:
        out = out * tl.load(gw_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows64[:, None] * N + cols64[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])
