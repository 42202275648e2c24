"""The transposed-operand quantizer kernels: the wgrad operands ``dY^T`` / ``X^T`` (tokens as the block dimension,
read from the row-major activations through a transposed view, padded or gathered) with the 16-point RHT.

Same operand, arithmetic and bits as ``_quantize_kernels._amax_kernel`` / ``_cast_kernel`` (formula "te",
1x16 blocks, tensor scaling per row group); only the data layout differs. There the tile is one
[rows, blocks, 16] tensor; read through a transposed view its contiguous axis is the rows, so the compiler
spreads each 16-block over several threads and every RHT stage (split / join / permute on the block axis)
and every block reduction moves data between threads. Here a tile is 16 planes [rows, blocks], plane j
holding element j of every block: all planes share one layout (rows contiguous: coalesced loads), the
butterfly is elementwise between planes and a block's amax a max over planes, so nothing leaves its thread.
The cast joins a block's 16 codes into one 8-byte word (and its dequantized values into words of 4 BF16 or
2 fp32) before storing: per-plane byte stores at a row's stride cost more than the planes save (H200,
docs/KERNELS_NOTES.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._quantize_kernels import _FLT_MAX, _RHT_NEG_MASK, _bf16_rne, _hash32


@triton.jit
def _plane(x_ptr, gather_ptr, rows, blk, J: tl.constexpr, R, C, CW, stride_r, stride_c, GATHER: tl.constexpr,
           RHT: tl.constexpr):
    """Element J of every block of the tile (rows [BR, 1], blocks [1, NB]) as fp32, sign-flipped (exactly) by
    TE's RHT sign vector when RHT != 0, then float64 for the butterfly."""
    cols = blk * 16 + J
    if GATHER:
        src = tl.load(gather_ptr + cols, mask=cols < CW, other=-1)
        cmask = src >= 0
    else:
        src = cols
        cmask = cols < C
    x = tl.load(x_ptr + rows.to(tl.int64) * stride_r + src.to(tl.int64) * stride_c, mask=(rows < R) & cmask,
                other=0.0).to(tl.float32)
    if RHT != 0:
        if (_RHT_NEG_MASK >> J) & 1:
            x = x * -1.0
        x = x.to(tl.float64)
    return x


@triton.jit
def _h2(a, b):
    return a + b, a - b


@triton.jit
def _out(y, RHT: tl.constexpr):
    """A butterfly output: x 1/4 in float64, rounded to fp32, then to the input's precision."""
    y = (y * 0.25).to(tl.float32)
    if RHT == 2:
        y = _bf16_rne(y)
    elif RHT == 3:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _planes(x_ptr, gather_ptr, rows, blk, R, C, CW, stride_r, stride_c, GATHER: tl.constexpr, RHT: tl.constexpr):
    """The tile's 16 planes after the RHT (``minite.nvfp4.rht16``'s butterfly: index bit 0 first, a + b / a - b
    on the pairs that differ in that bit), or as loaded when RHT == 0."""
    y0 = _plane(x_ptr, gather_ptr, rows, blk, 0, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y1 = _plane(x_ptr, gather_ptr, rows, blk, 1, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y2 = _plane(x_ptr, gather_ptr, rows, blk, 2, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y3 = _plane(x_ptr, gather_ptr, rows, blk, 3, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y4 = _plane(x_ptr, gather_ptr, rows, blk, 4, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y5 = _plane(x_ptr, gather_ptr, rows, blk, 5, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y6 = _plane(x_ptr, gather_ptr, rows, blk, 6, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y7 = _plane(x_ptr, gather_ptr, rows, blk, 7, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y8 = _plane(x_ptr, gather_ptr, rows, blk, 8, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y9 = _plane(x_ptr, gather_ptr, rows, blk, 9, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y10 = _plane(x_ptr, gather_ptr, rows, blk, 10, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y11 = _plane(x_ptr, gather_ptr, rows, blk, 11, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y12 = _plane(x_ptr, gather_ptr, rows, blk, 12, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y13 = _plane(x_ptr, gather_ptr, rows, blk, 13, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y14 = _plane(x_ptr, gather_ptr, rows, blk, 14, R, C, CW, stride_r, stride_c, GATHER, RHT)
    y15 = _plane(x_ptr, gather_ptr, rows, blk, 15, R, C, CW, stride_r, stride_c, GATHER, RHT)
    if RHT != 0:
        y0, y1 = _h2(y0, y1)        # bit 0
        y2, y3 = _h2(y2, y3)
        y4, y5 = _h2(y4, y5)
        y6, y7 = _h2(y6, y7)
        y8, y9 = _h2(y8, y9)
        y10, y11 = _h2(y10, y11)
        y12, y13 = _h2(y12, y13)
        y14, y15 = _h2(y14, y15)
        y0, y2 = _h2(y0, y2)        # bit 1
        y1, y3 = _h2(y1, y3)
        y4, y6 = _h2(y4, y6)
        y5, y7 = _h2(y5, y7)
        y8, y10 = _h2(y8, y10)
        y9, y11 = _h2(y9, y11)
        y12, y14 = _h2(y12, y14)
        y13, y15 = _h2(y13, y15)
        y0, y4 = _h2(y0, y4)        # bit 2
        y1, y5 = _h2(y1, y5)
        y2, y6 = _h2(y2, y6)
        y3, y7 = _h2(y3, y7)
        y8, y12 = _h2(y8, y12)
        y9, y13 = _h2(y9, y13)
        y10, y14 = _h2(y10, y14)
        y11, y15 = _h2(y11, y15)
        y0, y8 = _h2(y0, y8)        # bit 3
        y1, y9 = _h2(y1, y9)
        y2, y10 = _h2(y2, y10)
        y3, y11 = _h2(y3, y11)
        y4, y12 = _h2(y4, y12)
        y5, y13 = _h2(y5, y13)
        y6, y14 = _h2(y6, y14)
        y7, y15 = _h2(y7, y15)
        y0, y1, y2, y3 = _out(y0, RHT), _out(y1, RHT), _out(y2, RHT), _out(y3, RHT)
        y4, y5, y6, y7 = _out(y4, RHT), _out(y5, RHT), _out(y6, RHT), _out(y7, RHT)
        y8, y9, y10, y11 = _out(y8, RHT), _out(y9, RHT), _out(y10, RHT), _out(y11, RHT)
        y12, y13, y14, y15 = _out(y12, RHT), _out(y13, RHT), _out(y14, RHT), _out(y15, RHT)
    return y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15


@triton.jit
def _bits(y):
    return y.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _block_bits(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """max |y_j| over the planes as fp32 bits (an int32 max, NaN above Inf: the amax pass's reduction)."""
    m = tl.maximum(tl.maximum(tl.maximum(_bits(y0), _bits(y1)), tl.maximum(_bits(y2), _bits(y3))),
                   tl.maximum(tl.maximum(_bits(y4), _bits(y5)), tl.maximum(_bits(y6), _bits(y7))))
    m2 = tl.maximum(tl.maximum(tl.maximum(_bits(y8), _bits(y9)), tl.maximum(_bits(y10), _bits(y11))),
                    tl.maximum(tl.maximum(_bits(y12), _bits(y13)), tl.maximum(_bits(y14), _bits(y15))))
    return tl.maximum(m, m2)


@triton.jit
def _am(a, b):
    return tl.maximum(tl.abs(a), tl.abs(b))


@triton.jit
def _block_absmax(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """max |y_j| over the planes as a float max (the cast's block amax: ``tl.max`` over the block in the 3D
    kernel, whose maximum drops a NaN operand as this one does)."""
    m = tl.maximum(tl.maximum(_am(y0, y1), _am(y2, y3)), tl.maximum(_am(y4, y5), _am(y6, y7)))
    m2 = tl.maximum(tl.maximum(_am(y8, y9), _am(y10, y11)), tl.maximum(_am(y12, y13), _am(y14, y15)))
    return tl.maximum(m, m2)


@triton.jit
def _tile(BR: tl.constexpr, NB: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    return rows[:, None], blk[None, :]


@triton.jit
def amax_planes_kernel(x_ptr, gather_ptr, amax_ptr, R, C, CW, stride_r, stride_c, rows_per_group,
                       BR: tl.constexpr, NB: tl.constexpr, GATHER: tl.constexpr, RHT: tl.constexpr,
                       TILE_IN_GROUP: tl.constexpr):
    rows, blk = _tile(BR, NB)
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _planes(
        x_ptr, gather_ptr, rows, blk, R, C, CW, stride_r, stride_c, GATHER, RHT)
    bits = tl.max(_block_bits(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15), axis=1)
    if TILE_IN_GROUP:
        tl.atomic_max(amax_ptr + (tl.program_id(0) * BR) // rows_per_group, tl.max(bits, axis=0))
    else:
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        tl.atomic_max(amax_ptr + r // rows_per_group, bits, mask=r < R)


@triton.jit
def _e2m1(y, enc, idx, seed, STOCHASTIC: tl.constexpr):
    """The 4-bit code of one plane (sign bit 3), as ``_cast_kernel`` forms it."""
    v = tl.clamp(y * enc, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
    a = tl.abs(v)
    if STOCHASTIC:
        lo = ((a >= 0.5).to(tl.uint32) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0)
              + (a >= 4.0) + (a >= 6.0))
        lo_val = tl.where(lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo < 7, lo.to(tl.float32) - 2.0, 6.0))
        inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
        frac = (a - lo_val) * inv_step
        hsh = _hash32(_hash32(idx) ^ seed.to(tl.uint32))
        u = (hsh >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        mag = lo + ((u < frac) & (lo < 7)).to(tl.uint32)
    else:
        mag = ((a > 0.25).to(tl.uint32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
               + (a >= 3.5) + (a > 5.0))
    return mag | ((v < 0).to(tl.uint32) << 3)


@triton.jit
def _code(y, J: tl.constexpr, enc, base, seed, STOCHASTIC: tl.constexpr):
    """Element J of every block: its 4-bit code as uint64 (the stochastic stream's index base + J)."""
    return _e2m1(y, enc, (base + J).to(tl.uint32), seed, STOCHASTIC).to(tl.uint64)


@triton.jit
def _dq_bits(code, s_q, s_dec, DQ: tl.constexpr):
    """The dequantized value of a code as uint64 bits: the BF16 bits (DQ == 2) or the fp32 bits."""
    mag = code.to(tl.uint32) & 7
    m = mag.to(tl.float32)
    mval = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, tl.where(m < 7.0, 4.0, 6.0)))
    val = (mval.to(tl.uint32, bitcast=True) | (((code.to(tl.uint32) >> 3) & 1) << 31)).to(tl.float32, bitcast=True)
    y = (val * s_q) * s_dec
    if DQ == 2:
        return (_bf16_rne(y).to(tl.uint32, bitcast=True) >> 16).to(tl.uint64)
    return y.to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def _store_words(ptr, w, rows, blk, R, WPB: tl.constexpr, WPR, I: tl.constexpr):  # noqa: E741 (word index)
    """Word I of each block's WPB 8-byte words, at word column blk * WPB + I of a row of WPR words."""
    col = blk * WPB + I
    tl.store(ptr + rows.to(tl.int64) * WPR + col, w.to(tl.int64, bitcast=True), mask=(rows < R) & (col < WPR))


@triton.jit
def _dq_words(dq_ptr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, s_q, s_dec,
              rows, blk, R, CW, DQ: tl.constexpr):
    """The block's 16 dequantized values as 8-byte words: 4 BF16 or 2 fp32 values each, lowest index in the
    low bits (little endian: the element order in memory)."""
    if DQ == 2:
        wpr = CW // 4
        _store_words(dq_ptr, _dq_bits(c0, s_q, s_dec, DQ) | (_dq_bits(c1, s_q, s_dec, DQ) << 16)
                     | (_dq_bits(c2, s_q, s_dec, DQ) << 32) | (_dq_bits(c3, s_q, s_dec, DQ) << 48),
                     rows, blk, R, 4, wpr, 0)
        _store_words(dq_ptr, _dq_bits(c4, s_q, s_dec, DQ) | (_dq_bits(c5, s_q, s_dec, DQ) << 16)
                     | (_dq_bits(c6, s_q, s_dec, DQ) << 32) | (_dq_bits(c7, s_q, s_dec, DQ) << 48),
                     rows, blk, R, 4, wpr, 1)
        _store_words(dq_ptr, _dq_bits(c8, s_q, s_dec, DQ) | (_dq_bits(c9, s_q, s_dec, DQ) << 16)
                     | (_dq_bits(c10, s_q, s_dec, DQ) << 32) | (_dq_bits(c11, s_q, s_dec, DQ) << 48),
                     rows, blk, R, 4, wpr, 2)
        _store_words(dq_ptr, _dq_bits(c12, s_q, s_dec, DQ) | (_dq_bits(c13, s_q, s_dec, DQ) << 16)
                     | (_dq_bits(c14, s_q, s_dec, DQ) << 32) | (_dq_bits(c15, s_q, s_dec, DQ) << 48),
                     rows, blk, R, 4, wpr, 3)
    else:
        wpr = CW // 2
        _store_words(dq_ptr, _dq_bits(c0, s_q, s_dec, DQ) | (_dq_bits(c1, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 0)
        _store_words(dq_ptr, _dq_bits(c2, s_q, s_dec, DQ) | (_dq_bits(c3, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 1)
        _store_words(dq_ptr, _dq_bits(c4, s_q, s_dec, DQ) | (_dq_bits(c5, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 2)
        _store_words(dq_ptr, _dq_bits(c6, s_q, s_dec, DQ) | (_dq_bits(c7, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 3)
        _store_words(dq_ptr, _dq_bits(c8, s_q, s_dec, DQ) | (_dq_bits(c9, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 4)
        _store_words(dq_ptr, _dq_bits(c10, s_q, s_dec, DQ) | (_dq_bits(c11, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 5)
        _store_words(dq_ptr, _dq_bits(c12, s_q, s_dec, DQ) | (_dq_bits(c13, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 6)
        _store_words(dq_ptr, _dq_bits(c14, s_q, s_dec, DQ) | (_dq_bits(c15, s_q, s_dec, DQ) << 32),
                     rows, blk, R, 8, wpr, 7)


@triton.jit(do_not_specialize=["seed"])
def cast_planes_kernel(x_ptr, gather_ptr, amax_ptr, codes_ptr, scales_ptr, gsdec_ptr, dq_ptr,
                       R, C, CW, stride_r, stride_c, rows_per_group, seed,
                       BR: tl.constexpr, NB: tl.constexpr, GATHER: tl.constexpr, RHT: tl.constexpr,
                       STOCHASTIC: tl.constexpr, CODES: tl.constexpr, DQ: tl.constexpr):
    """``_cast_kernel`` for formula "te", 1x16 blocks, a group amax from ``amax_ptr`` (no ROW_AMAX, TILE16,
    CHECK, per-row S_dec): codes + E4M3 scales and / or the dequantized values, S_dec per group. The codes
    and values leave as 8-byte words (``codes_ptr`` / ``dq_ptr`` are int64 views), one store per block or per
    4 BF16 / 2 fp32 values: a thread holds whole blocks, so no byte-wide stores at a row's stride."""
    rows, blk = _tile(BR, NB)
    r1 = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r1 < R
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _planes(
        x_ptr, gather_ptr, rows, blk, R, C, CW, stride_r, stride_c, GATHER, RHT)
    bamax = _block_absmax(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)  # [BR, NB]
    amax = tl.load(amax_ptr + r1 // rows_per_group, mask=rmask, other=0.0)
    s_enc = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), _FLT_MAX)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
    mult = s_enc * 0.16666666666666666
    if tl.program_id(1) == 0:
        tl.store(gsdec_ptr + r1 // rows_per_group, s_dec, mask=rmask & (r1 % rows_per_group == 0))
    sv = tl.clamp(bamax * mult[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = sv.to(tl.uint32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    is_norm = sv >= 0.015625
    s_sub = (sv + 16384.0) - 16384.0
    s_q = tl.where(is_norm, rb.to(tl.float32, bitcast=True), s_sub)
    if CODES:
        code_norm = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
        s_code = tl.where(is_norm, code_norm, (s_sub * 512.0).to(tl.uint32))
        s_code = tl.where(sv != sv, 0x7F | ((bits >> 24) & 0x80), s_code).to(tl.uint8)
        tl.store(scales_ptr + rows.to(tl.int64) * (CW // 16) + blk, s_code, mask=(rows < R) & (blk < CW // 16))
    enc = tl.minimum(tl.math.div_rn(tl.full(s_q.shape, 1.0, tl.float32), s_q * s_dec[:, None]), _FLT_MAX)
    sd = s_dec[:, None]
    base = rows.to(tl.int64) * CW + blk * 16       # the stochastic stream's element index, as the 3D kernel's
    c0, c1 = _code(y0, 0, enc, base, seed, STOCHASTIC), _code(y1, 1, enc, base, seed, STOCHASTIC)
    c2, c3 = _code(y2, 2, enc, base, seed, STOCHASTIC), _code(y3, 3, enc, base, seed, STOCHASTIC)
    c4, c5 = _code(y4, 4, enc, base, seed, STOCHASTIC), _code(y5, 5, enc, base, seed, STOCHASTIC)
    c6, c7 = _code(y6, 6, enc, base, seed, STOCHASTIC), _code(y7, 7, enc, base, seed, STOCHASTIC)
    c8, c9 = _code(y8, 8, enc, base, seed, STOCHASTIC), _code(y9, 9, enc, base, seed, STOCHASTIC)
    c10, c11 = _code(y10, 10, enc, base, seed, STOCHASTIC), _code(y11, 11, enc, base, seed, STOCHASTIC)
    c12, c13 = _code(y12, 12, enc, base, seed, STOCHASTIC), _code(y13, 13, enc, base, seed, STOCHASTIC)
    c14, c15 = _code(y14, 14, enc, base, seed, STOCHASTIC), _code(y15, 15, enc, base, seed, STOCHASTIC)
    if CODES:  # the block's 16 codes as one 8-byte word: element j in bits 4j..4j+3 (2K low nibble of byte K)
        word = (c0 | (c1 << 4) | (c2 << 8) | (c3 << 12) | (c4 << 16) | (c5 << 20) | (c6 << 24) | (c7 << 28)
                | (c8 << 32) | (c9 << 36) | (c10 << 40) | (c11 << 44) | (c12 << 48) | (c13 << 52) | (c14 << 56)
                | (c15 << 60))
        _store_words(codes_ptr, word, rows, blk, R, 1, CW // 16, 0)
    if DQ != 0:
        _dq_words(dq_ptr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, s_q, sd,
                  rows, blk, R, CW, DQ)
