"""Triton kernels behind ``minite.kernels.quantize`` (the entry points, their contract and tile choices live
there). Every kernel reproduces ``minite.nvfp4`` bit for bit; the notes below say how.

The operand. A kernel reads a 2D view ``x`` [R, C] through its strides (a transposed view ``x.t()`` costs no
copy) and quantizes the *logical* operand X' [R, CW] along its second dim: X'[r, c] = x[r, src(c)] with
src(c) = gather[c] (``GATHER``; -1 = a zero column) or c (zero for c >= C: right padding to CW).

    _amax_kernel    max |X'| (after the RHT when asked) per group of ``rows_per_group`` rows, reduced on the
                    fp32 bits as int32 (non-negative floats order like their bits; NaN sorts above Inf, so a
                    bad input always shows up in the amax) with one atomic_max per tile or per row.
    _cast_kernel    one pass per tile: load, RHT, global and block scales (formula "te" or "vllm"), E2M1 codes
                    (RNE or the counter-hash stochastic stream), and any of: packed codes + E4M3 scales, S_dec per
                    row / per group, the dequantized values (fp32 or BF16), NaN/Inf counts per program (the
                    input's; for "vllm" also its global encode scale G's).
    _dequant_kernel codes + scales + S_dec -> fp32 or BF16 values.

Fused producers (the operand is computed as it is loaded, by the helpers of the op it stands for, so the values
are that op's):
  * ``SILU_MUL`` (the expert down projection's input): the cast reads gate x and up (same shape, row stride
    ``stride_ur``) and quantizes SiLU(gate) * up as ``fused_ops.silu_mul`` rounds it; its [R, C] output never
    goes to memory.
  * ``NORM`` (the input of the linear after an RMSNorm): the cast is the norm's last pass. It reads the rows
    the norm normalises (x), their mean squares ``var_ptr`` [R] (torch's mean, taken before) and the weight
    [C], forms the norm's output as ``fused_ops.rms_norm`` does, stores it (``y_ptr`` [R, C], contiguous:
    the norm's result for its other readers) and quantizes it. With NORM_J (rows of C = 128 NORM_J, one per
    program) it takes the mean square itself, in torch's order (``_row_square_sum``), and with NORM_RES it
    reads x and the residual (``res_ptr``), forms their sum and stores it (``summed_ptr``, the new residual):
    the norm in one launch. With COMBINE_K (NORM_J only) x's row is first written by the program itself: the
    experts' combine of ``cy_ptr`` / ``cinv_ptr`` / ``cw_ptr`` (``store_combined_row``).

Arithmetic rules that keep the bits equal to the PyTorch reference:
  * E4M3 rounding is done on fp32 bits; every division is ``div_rn``; no fp8 types in the kernels. The cast
    is compiled without FMA contraction (vLLM's zero guard ``v + (v == 0) * 1e8`` is a multiply-add).
  * Clamps propagate NaN, as ``torch.clamp`` does: vLLM's scales can make 0 * inf (a G near the fp32 range
    ends), and the reference then gives code 0 (and a NaN E4M3 scale), not a clamped +-6 / 448.
  * BF16 rounding is RNE on fp32 bits (the interpreter's bf16 cast truncates).
  * Signs are set as bits, never by unary minus: Triton 3.6 lowers ``-x`` to ``0 - x`` (+0.0 for x = +0.0).
  * The RHT is ``minite.nvfp4.rht16``'s float64 butterfly, stage for stage (elementwise: Triton 3.6 cannot
    build an fp64 dot with K=16 on sm_90): sign flips, four a+b / a-b stages (index bit 0 first), x 1/4,
    rounded to fp32 and then to the input's dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_fused_ops import _norm_half, _residual_sum, _row_square_sum, _rsqrtf, silu_mul_values, store_combined_row
from ._triton_pdl import pdl_wait

_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # jit code reads globals only as constexpr
#: bit i set where TE's RHT sign vector (minite.nvfp4.RHT_SIGNS) is -1
_RHT_NEG_MASK = tl.constexpr(sum(1 << i for i, s in enumerate(
    (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)) if s < 0))
#: RHT output precision (constexpr RHT): 0 = no RHT, 1 = fp32, 2 = BF16, 3 = FP16
RHT_NONE, RHT_F32, RHT_BF16, RHT_F16 = 0, 1, 2, 3
#: dequantized output (constexpr DQ): 0 = none, 1 = fp32, 2 = BF16 (stored as int16 bits), 3 = the GEMM's fp16
#: form of the codes (``weights.decode_f16``: value * 2**-14, its K order, rows cdiv(CW, 128) * 128 wide; needs CODES)
DQ_NONE, DQ_F32, DQ_BF16, DQ_F16_GEMM = 0, 1, 2, 3
#: the cast's producer (constexpr SILU_MUL): 0 = the operand itself, SiLU(gate) * up in mode "hf" / "vllm"
SILU_NONE, SILU_HF, SILU_VLLM = 0, 1, 2
#: the norm producer (constexpr NORM): 0 = none, RMSNorm's last pass in mode "hf" / "vllm"
NORM_NONE, NORM_HF, NORM_VLLM = 0, 1, 2
#: the scale formula (constexpr FORMULA), as minite.nvfp4.quantize's
FORMULA_TE, FORMULA_VLLM = 0, 1


@triton.jit
def _hash32(x):
    # minite.nvfp4._hash32 on uint32 (the multiplies wrap mod 2**32 exactly like the int64 & mask form)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x297A2D39
    return x ^ (x >> 16)


@triton.jit
def _bf16_rne(y):
    """fp32 -> the nearest BF16 value (ties to even), still as fp32; finite or not. A NaN stays a (quiet) NaN:
    the rounding carry would turn the GPU's 0x7FFFFFFF into -0 (torch's own NaN bits differ by device)."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = tl.where(y != y, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _vllm_recip(v):
    """minite.nvfp4._vllm_recip: 1 / (v + (v == 0) * 1e8), vLLM's zero guard, op for op."""
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), v + (v == 0).to(tl.float32) * 1e8)


@triton.jit
def _load_operand(x_ptr, gather_ptr, rows, cols, R, C, CW, stride_r, stride_c, GATHER: tl.constexpr):
    """X'[rows, cols] as fp32 (zeros outside the operand); rows / cols broadcastable index tensors."""
    if GATHER:
        src = tl.load(gather_ptr + cols, mask=cols < CW, other=-1)
        cmask = src >= 0
    else:
        src = cols
        cmask = cols < C
    ptrs = x_ptr + rows.to(tl.int64) * stride_r + src.to(tl.int64) * stride_c
    return tl.load(ptrs, mask=(rows < R) & cmask, other=0.0).to(tl.float32)


@triton.jit
def _rht16(x, RHT: tl.constexpr):
    """minite.nvfp4.rht16 on the blocks of an fp32 tile [BR, NB, 16]."""
    BR: tl.constexpr = x.shape[0]
    NB: tl.constexpr = x.shape[1]
    i = tl.arange(0, 16)
    sign = 1.0 - 2.0 * ((tl.full((16,), _RHT_NEG_MASK, tl.int32) >> i) & 1).to(tl.float32)  # +-1
    y = tl.reshape((x * sign[None, None, :]).to(tl.float64), (BR * NB, 2, 2, 2, 2))  # exact sign flips
    for _ in tl.static_range(4):
        # H2 on the last index bit, then rotate the next bit last: after four stages the order is natural
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 4, 1, 2, 3))
    y = (tl.reshape(y, (BR, NB, 16)) * 0.25).to(tl.float32)
    if RHT == 2:
        y = _bf16_rne(y)
    elif RHT == 3:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _tile_index(BR: tl.constexpr, BC: tl.constexpr):
    """Row and column indices of this program's tile, shaped [BR, 1, 1] and [1, BC // 16, 16]: the tile is
    held as [rows, blocks, 16] from the load on, so a block's 16 values sit in one or two threads."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    blk = tl.program_id(1) * (BC // 16) + tl.arange(0, BC // 16)
    cols = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    return rows[:, None, None], cols[None, :, :]


@triton.jit
def _amax_kernel(x_ptr, gather_ptr, amax_ptr, R, C, CW, stride_r, stride_c, rows_per_group,
                 BR: tl.constexpr, BC: tl.constexpr, GATHER: tl.constexpr, RHT: tl.constexpr,
                 TILE_IN_GROUP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows3, cols3 = _tile_index(BR, BC)
    x = _load_operand(x_ptr, gather_ptr, rows3, cols3, R, C, CW, stride_r, stride_c, GATHER)
    if RHT != 0:
        x = _rht16(x, RHT)
    bits = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=1)  # [BR]
    if TILE_IN_GROUP:  # the whole tile lies in one group: one atomic per program
        tl.atomic_max(amax_ptr + (tl.program_id(0) * BR) // rows_per_group, tl.max(bits, axis=0))
    else:
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        tl.atomic_max(amax_ptr + rows // rows_per_group, bits, mask=rows < R)


@triton.jit(do_not_specialize=["seed"])
def _cast_kernel(x_ptr, gather_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr, gsdec_ptr, dq_ptr, bad_ptr, up_ptr,
                 var_ptr, w_ptr, y_ptr, res_ptr, summed_ptr, cy_ptr, cinv_ptr, cw_ptr, R, C, CW, stride_r, stride_c,
                 stride_ur, stride_rr, stride_cy, rows_per_group, seed, eps, inv_n,
                 BR: tl.constexpr, BC: tl.constexpr, GATHER: tl.constexpr, RHT: tl.constexpr,
                 TILE16: tl.constexpr, ROW_AMAX: tl.constexpr, STOCHASTIC: tl.constexpr, CODES: tl.constexpr,
                 DQ: tl.constexpr, CHECK: tl.constexpr, SDEC_ROWS: tl.constexpr, FORMULA: tl.constexpr,
                 GIVEN_G: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, NORM_J: tl.constexpr,
                 NORM_RES: tl.constexpr, COMBINE_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    NB: tl.constexpr = BC // 16
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows3, cols3 = _tile_index(BR, BC)           # [BR, 1, 1], [1, NB, 16]
    rows = pr * BR + tl.arange(0, BR)
    rmask = rows < R
    if SILU_MUL != 0:  # SILU_NONE; no gather / padding here: zeros outside [R, C] (SiLU(0) * 0 = 0)
        inside = (rows3 < R) & (cols3 < C)
        gv = tl.load(x_ptr + rows3.to(tl.int64) * stride_r + cols3.to(tl.int64) * stride_c, mask=inside, other=0.0)
        uv = tl.load(up_ptr + rows3.to(tl.int64) * stride_ur + cols3.to(tl.int64) * stride_c, mask=inside,
                     other=0.0)
        x = silu_mul_values(gv, uv, SILU_MUL == 1).to(tl.float32)  # SILU_HF
    elif NORM != 0:  # NORM_NONE; as SILU_MUL: zeros outside [R, C] (a zero weight there)
        inside = (rows3 < R) & (cols3 < C)
        wv = tl.load(w_ptr + cols3, mask=cols3 < C, other=0.0)
        if NORM_J != 0:  # the mean square here (one row per program, C = 128 NORM_J, unit column stride)
            if NORM_RES:  # before the combine, which it does not wait for
                rv = tl.load(res_ptr + rows3.to(tl.int64) * stride_rr + cols3, mask=inside, other=0.0)
            if COMBINE_K != 0:  # x's row is the experts' combine, written here first (x contiguous)
                store_combined_row(x_ptr, pr.to(tl.int64), cy_ptr, stride_cy, cinv_ptr, cw_ptr, C, COMBINE_K,
                                   NORM == 1, BC)
            # the tile's loads first: in flight beside the mean's (else one more memory latency after them)
            sv = tl.load(x_ptr + rows3.to(tl.int64) * stride_r + cols3, mask=inside, other=0.0)
            var = _row_square_sum(x_ptr + pr.to(tl.int64) * stride_r, res_ptr + pr.to(tl.int64) * stride_rr,
                                  NORM_RES, NORM == 1, NORM_J) * inv_n
            if NORM_RES:  # the residual sum: the norm's input and the new residual, stored after every load
                sv = _residual_sum(sv, rv, NORM == 1)
                tl.store(summed_ptr + rows3.to(tl.int64) * C + cols3, sv, mask=inside)
            inv = _rsqrtf(var + eps)
        else:  # torch's mean, from the norm's square pass
            sv = tl.load(x_ptr + rows3.to(tl.int64) * stride_r + cols3.to(tl.int64) * stride_c, mask=inside,
                         other=0.0)
            inv = _rsqrtf(tl.load(var_ptr + rows3, mask=rows3 < R, other=1.0) + eps)
        yv = _norm_half(sv, inv, wv, NORM == 1)  # NORM_HF
        tl.store(y_ptr + rows3.to(tl.int64) * C + cols3, yv, mask=inside)
        x = yv.to(tl.float32)
    else:
        x = _load_operand(x_ptr, gather_ptr, rows3, cols3, R, C, CW, stride_r, stride_c, GATHER)
    if RHT != 0:
        x = _rht16(x, RHT)
    if CHECK:  # NaN/Inf count per program (the caller raises); after the RHT, which can itself overflow
        badv = ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
        tl.store(bad_ptr + pr * tl.num_programs(1) + pc, tl.sum(tl.sum(tl.sum(badv, axis=2), axis=1), axis=0))
    ax = tl.abs(x)
    bamax = tl.max(ax, axis=2)                   # [BR, NB]: 1x16 block amax
    if ROW_AMAX:  # the tile holds whole rows
        amax = tl.max(bamax, axis=1)
    else:  # the row's amax, or (GIVEN_G) vLLM's encode scale G itself
        amax = tl.load(amax_ptr + rows // rows_per_group, mask=rmask, other=0.0)
    if FORMULA == 0:  # te: S_enc = min(2688 / amax, FLT_MAX), 1 where amax == 0 or S_enc == 0; S_dec = 1 / S_enc
        s_enc = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), _FLT_MAX)
        s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
        s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
        mult = s_enc * 0.16666666666666666  # S_enc * fp32(1/6), formed first
    else:  # vllm: G = recip(amax / 2688) unless given, S_dec = recip(G)
        if GIVEN_G:
            g = amax
        else:
            g = _vllm_recip(tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32)))
        s_dec = _vllm_recip(g)
        if CHECK:  # G overflows for a tiny nonzero amax (or a given G past fp32): the reference raises
            gbad = ((g != g) | (tl.abs(g) == float("inf"))) & rmask
            tl.store(bad_ptr + (tl.num_programs(0) + pr) * tl.num_programs(1) + pc, tl.sum(gbad.to(tl.int32), axis=0))
    if pc == 0:
        if SDEC_ROWS:
            tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        tl.store(gsdec_ptr + rows // rows_per_group, s_dec, mask=rmask & (rows % rows_per_group == 0))
    if TILE16:  # the 16x16 tile's amax, repeated on its 16 rows
        t = tl.max(tl.reshape(bamax, (BR // 16, 16, NB)), axis=1)
        bamax = tl.reshape(tl.broadcast_to(t[:, None, :], (BR // 16, 16, NB)), (BR, NB))
    if FORMULA == 0:
        sv = bamax * mult[:, None]
    else:
        sv = g[:, None] * (bamax * 0.16666666666666666)  # G * (block_amax * fp32(1/6))
    # block scale e4m3(clamp(sv, +-448)) (TE's FLT_MAX clamp before it changes nothing), rounded to nearest-even
    # on the fp32 bits; sv >= 0 or NaN
    sv = tl.clamp(sv, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = sv.to(tl.uint32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    is_norm = sv >= 0.015625
    s_sub = (sv + 16384.0) - 16384.0  # RNE onto the 2**-9 subnormal grid
    s_q = tl.where(is_norm, rb.to(tl.float32, bitcast=True), s_sub)
    if CODES:
        code_norm = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
        s_code = tl.where(is_norm, code_norm, (s_sub * 512.0).to(tl.uint32))
        s_code = tl.where(sv != sv, 0x7F | ((bits >> 24) & 0x80), s_code).to(tl.uint8)  # NaN as torch's cast
        scols = pc * NB + tl.arange(0, NB)
        tl.store(scales_ptr + rows.to(tl.int64)[:, None] * (CW // 16) + scols[None, :], s_code,
                 mask=rmask[:, None] & (scols[None, :] < CW // 16))
    if FORMULA == 0:
        enc = tl.minimum(tl.math.div_rn(tl.full(s_q.shape, 1.0, tl.float32), s_q * s_dec[:, None]), _FLT_MAX)
    else:
        enc = _vllm_recip(s_q * s_dec[:, None])
    v = tl.clamp(x * enc[:, :, None], -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)  # NaN -> code 0
    a = tl.abs(v)
    if STOCHASTIC:  # up with probability (a - lo) / (hi - lo), u from hash(hash(index) ^ seed)
        lo = ((a >= 0.5).to(tl.uint32) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0)
              + (a >= 4.0) + (a >= 6.0))
        lo_val = tl.where(lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo < 7, lo.to(tl.float32) - 2.0, 6.0))
        inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
        frac = (a - lo_val) * inv_step
        idx = (rows3.to(tl.int64) * CW + cols3).to(tl.uint32)
        hsh = _hash32(_hash32(idx) ^ seed.to(tl.uint32))
        u = (hsh >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        mag = lo + ((u < frac) & (lo < 7)).to(tl.uint32)
    else:  # nearest, ties to the even code
        mag = ((a > 0.25).to(tl.uint32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
               + (a >= 3.5) + (a > 5.0))
    neg = (v < 0).to(tl.uint32)
    if CODES:  # element 2j in the low nibble of byte j
        even, odd = tl.split(tl.reshape(mag | (neg << 3), (BR, NB, 8, 2)))
        pcols = (pc * NB + tl.arange(0, NB))[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(codes_ptr + rows3.to(tl.int64) * (CW // 2) + pcols[None, :, :], (even | (odd << 4)).to(tl.uint8),
                 mask=(rows3 < R) & (pcols[None, :, :] < CW // 2))
        if DQ == 3:  # DQ_F16_GEMM: from the code and scale bytes just stored, as _triton_gemm._decode reads them
            sf = ((s_code.to(tl.int32) << 7).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)
            ev = (((even & 0x7) << 9) | ((even & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
            od = (((odd & 0x7) << 9) | ((odd & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
            ev = (ev * sf[:, :, None]).to(tl.float16)
            od = (od * sf[:, :, None]).to(tl.float16)
            # a 128-wide K step holds its 64 even-K values, then its 64 odd-K values; block b is the (b % 8)-th
            # 8 of its step's halves
            blk = pc * NB + tl.arange(0, NB)
            fcols = ((blk // 8) * 128 + (blk % 8) * 8)[:, None] + tl.arange(0, 8)[None, :]
            fptr = dq_ptr + rows3.to(tl.int64) * (tl.cdiv(CW, 128) * 128) + fcols[None, :, :]
            fmask = (rows3 < R) & (blk[None, :, None] < CW // 16)
            tl.store(fptr, ev, mask=fmask)
            tl.store(fptr + 64, od, mask=fmask)
    if (DQ == 1) | (DQ == 2):  # (e2m1 * scale) * S_dec, as minite.nvfp4.dequantize
        m = mag.to(tl.float32)
        mval = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, tl.where(m < 7.0, 4.0, 6.0)))
        val = (mval.to(tl.uint32, bitcast=True) | (neg << 31)).to(tl.float32, bitcast=True)
        y = (val * s_q[:, :, None]) * s_dec[:, None, None]
        dptr = dq_ptr + rows3.to(tl.int64) * CW + cols3
        dmask = (rows3 < R) & (cols3 < CW)
        if DQ == 2:
            tl.store(dptr, (_bf16_rne(y).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True),
                     mask=dmask)
        else:
            tl.store(dptr, y, mask=dmask)


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, g_ptr, y_ptr, n_blocks, blocks_per_row,
                    BLK: tl.constexpr, ROW_G: tl.constexpr, OUT_BF16: tl.constexpr):
    """BLK blocks of 16 per program: y = (e2m1(code) * e4m3(scale)) * g, fp32 (then BF16, RNE)."""
    b = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
    bmask = b < n_blocks
    p = tl.load(codes_ptr + b[:, None] * 8 + tl.arange(0, 8)[None, :], mask=bmask[:, None], other=0)
    p = p.to(tl.uint32)
    code = tl.reshape(tl.join(p & 0xF, p >> 4), (BLK, 16))  # element 2j = low nibble
    m = (code & 7).to(tl.float32)
    mag = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, tl.where(m < 7.0, 4.0, 6.0)))
    val = (mag.to(tl.uint32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    sb = tl.load(scales_ptr + b, mask=bmask, other=0).to(tl.uint32)  # e4m3 bits, decoded exactly
    e, man = (sb >> 3) & 0xF, sb & 7
    s_norm = (((e + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sc = tl.where(e == 0, man.to(tl.float32) * 0.001953125, s_norm)  # 2**-9 subnormal grid
    sc = (sc.to(tl.uint32, bitcast=True) | ((sb & 0x80) << 24)).to(tl.float32, bitcast=True)
    if ROW_G:
        g = tl.load(g_ptr + b // blocks_per_row, mask=bmask, other=1.0)
    else:
        g = tl.load(g_ptr + b * 0, mask=bmask, other=1.0)
    y = (val * sc[:, None]) * g[:, None]
    if OUT_BF16:
        y = (_bf16_rne(y).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    tl.store(y_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], y, mask=bmask[:, None])
