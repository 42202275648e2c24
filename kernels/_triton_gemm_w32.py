"""The NVFP4 GEMM main loop with 32-bit word loads (variants "decode32", "small", "w16w"; grouped too).

Why words: the byte-per-thread decode loop of ``_triton_gemm`` issues one-byte loads, which neither vectorize
nor go through cp.async, so every K step waits on memory. Here the codes are read as int32 words ([R, BK/8]
per K step) with the row stride passed as an argument (Triton then knows it is a multiple of 16 and issues
16-byte cp.async copies), and the scales as int32 words too when K % 64 == 0 (each code word's thread picks
its scale byte out of the word with a shift). Each thread decodes the 8 nibbles of its own words: the 4 low
nibbles are the step's even-K values, the 4 high ones its odd-K values, put back in order with ``tl.join``.
Values and K order are those of ``_triton_gemm`` (tests check bit equality in the interpreter; the first-use
probe checks it on the GPU), so batch invariance holds.

SWAP + A_F16 (variant "small", M <= 16): the weight tile is the dot's 64-row side, decoded from words in the
loop, and the tokens (pre-decoded fp16: 16 x K, tiny) its 16-wide side: no padded token rows are decoded and a
64-row weight slice per program streams the packed weight.
W_F16 (variant "w16w"): the weight is pre-decoded fp16 (``decode_f16``); only A is decoded in the loop.
Triton 3.6 fails in TritonGPUOptimizeDotOperands when a join/reshape-decoded tile is the dot's transposed
second operand, so a decoded tile is only ever the first operand here ("decode32", which decodes both, builds
with Triton 3.9 but not 3.6: kept for newer Triton, never a default).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_gemm import _l2_tile, _tile_index
from ._triton_pdl import pdl_wait
from ._triton_round import round_to


@triton.jit
def _nib(wd, shift: tl.constexpr, sf):
    """fp16 (e2m1 * 2**-14) * scale for the nibble at ``shift`` of each int32 word (product exact)."""
    c = wd >> shift
    bits = ((c & 0x7) << 9) | ((c & 0x8) << 12)
    return (bits.to(tl.uint16).to(tl.float16, bitcast=True) * sf).to(tl.float16)


@triton.jit
def _decode_words(w_ptrs, s_ptrs, s_shift, mask):
    """[R, BK/8] int32 code words + their scales -> (evens, odds) fp16 [R, BK/2]. ``s_ptrs`` point at the
    scale byte (uint8) or at the int32 word holding it (then ``s_shift`` selects the byte)."""
    wd = tl.load(w_ptrs, mask=mask, other=0)
    s = (tl.load(s_ptrs, mask=mask, other=0).to(tl.int32) >> s_shift) & 0xFF
    sf = ((s << 7).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)
    # byte b of word w holds elements 8w+2b (low nibble) and 8w+2b+1 (high nibble);
    # join(join(x0, x2), join(x1, x3)) lays x0..x3 out in order along a new minor axis of size 4
    ev = tl.join(tl.join(_nib(wd, 0, sf), _nib(wd, 16, sf)), tl.join(_nib(wd, 8, sf), _nib(wd, 24, sf)))
    od = tl.join(tl.join(_nib(wd, 4, sf), _nib(wd, 20, sf)), tl.join(_nib(wd, 12, sf), _nib(wd, 28, sf)))
    return (tl.reshape(ev, (ev.shape[0], ev.shape[1] * 4)),
            tl.reshape(od, (od.shape[0], od.shape[1] * 4)))


@triton.jit
def _k_range(acc, k_begin, k_end, a_w, a_s, w_w, w_s, a_h, w_h, rmask, nmask, wi, kw, s_shift, s_step,
             BK: tl.constexpr, SWAP: tl.constexpr, W_F16: tl.constexpr, A_F16: tl.constexpr):
    """acc + the products of K [k_begin, k_end) (k_begin a multiple of BK), step after step."""
    for k0 in range(k_begin, k_end, BK):
        kmask = (k0 // 8 + wi) < kw
        i = k0 // BK
        if A_F16:  # a_words is the pre-decoded fp16 activation [M, kp] (a_rs = kp)
            a_lo = tl.load(a_h + k0, mask=rmask[:, None], other=0.0)
            a_hi = tl.load(a_h + (k0 + BK // 2), mask=rmask[:, None], other=0.0)
        else:
            a_lo, a_hi = _decode_words(a_w + k0 // 8, a_s + i * s_step, s_shift[None, :],
                                       rmask[:, None] & kmask[None, :])
        if W_F16:
            w_lo = tl.load(w_h + k0, mask=nmask[:, None], other=0.0)
            w_hi = tl.load(w_h + (k0 + BK // 2), mask=nmask[:, None], other=0.0)
        else:
            w_lo, w_hi = _decode_words(w_w + k0 // 8, w_s + i * s_step, s_shift[None, :],
                                       nmask[:, None] & kmask[None, :])
        if SWAP:  # acc[n, m]: the same products in the same K order, operands swapped
            acc = tl.dot(w_lo, tl.trans(a_lo), acc)
            acc = tl.dot(w_hi, tl.trans(a_hi), acc)
        else:
            acc = tl.dot(a_lo, tl.trans(w_lo), acc)
            acc = tl.dot(a_hi, tl.trans(w_hi), acc)
    return acc


@triton.jit
def nvfp4_mm_w32_kernel(a_words, a_scales, w_words, w_scales, ga_ptr, gw_ptr, bias_ptr, out_ptr,
                        tile_expert_ptr, tile_row_ptr, offsets_ptr,
                        M, N, K, n_tiles_m, a_rs, w_rs, a_ss, w_ss,
                        w_estride_c, w_estride_s, gw_estride,
                        GA_ROW: tl.constexpr, GW_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, SCALE_WORDS: tl.constexpr = False, SWAP: tl.constexpr = False,
                        W_F16: tl.constexpr = False, A_F16: tl.constexpr = False, KC: tl.constexpr = 0,
                        PDL: tl.constexpr = False):
    """a_rs / w_rs: row strides of the code words (int32 units; fp16 units for W_F16), a_ss / w_ss: of the
    scales (bytes, or int32 words with SCALE_WORDS); w_estride_*: per-expert strides in those units."""
    pdl_wait(PDL)
    kw = K // 8   # int32 words per row
    if GROUPED:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(offsets_ptr + e + 1)
        w_words += e.to(tl.int64) * w_estride_c
        w_scales += e.to(tl.int64) * w_estride_s
        gw_ptr += e.to(tl.int64) * gw_estride
    else:
        pid_m, pid_n = _l2_tile(n_tiles_m, N, BN, GROUP_M)
        row0 = pid_m * BM
        row_end = M
    rows, cols, rmask, nmask, rows64, cols64 = _tile_index(row0, row_end, pid_n, N, BM, BN)
    wi = tl.arange(0, BK // 8)
    h = tl.arange(0, BK // 2)
    if SCALE_WORDS:  # scale byte j of the step sits in word j // 4 at bit 8 * (j % 4); j = wi // 2
        s_off = wi // 8
        s_shift = ((wi // 2) % 4) * 8
    else:
        s_off = wi // 2
        s_shift = wi * 0
    a_w = a_words + rows64[:, None] * a_rs + wi[None, :]
    w_w = w_words + cols64[:, None] * w_rs + wi[None, :]
    w_h = w_words + cols64[:, None] * w_rs + h[None, :]
    a_h = a_words + rows64[:, None] * a_rs + h[None, :]
    a_s = a_scales + rows64[:, None] * a_ss + s_off[None, :]
    w_s = w_scales + cols64[:, None] * w_ss + s_off[None, :]
    s_step = BK // 64 if SCALE_WORDS else BK // 16
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if KC == 0:
        acc = _k_range(acc, 0, K, a_w, a_s, w_w, w_s, a_h, w_h, rmask, nmask, wi, kw, s_shift, s_step, BK,
                       SWAP, W_F16, A_F16)
    else:  # the K-chunk contract: each chunk summed from zero, the chunk sums added in order (_triton_gemm)
        for c0 in range(0, K, KC):
            part = _k_range(tl.zeros_like(acc), c0, tl.minimum(c0 + KC, K), a_w, a_s, w_w, w_s, a_h, w_h, rmask,
                            nmask, wi, kw, s_shift, s_step, BK, SWAP, W_F16, A_F16)
            acc = acc + part
    if SWAP:
        acc = tl.trans(acc)
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
    tl.store(o_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])  # RNE

