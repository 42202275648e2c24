"""The Hopper (and interpreter) NVFP4 GEMM kernel: decode to fp16 in registers, tensor-core dot, fp32 acc.

Decode, exact in fp16 (no rounding anywhere before the accumulator):
    element  fp16 bits (sign << 15) | (mag << 9)  ==  e2m1 * 2**-14         (E2M1's layout inside fp16's)
    scale    fp16 bits (e4m3 & 0x7F) << 7         ==  scale * 2**-8, then * 256 (power of two: exact)
    product  e2m1 * 2**-14 * scale: a multiple of 2**-24 below 2**-2, representable in fp16 exactly.
So each operand carries 2**-14; the epilogue multiplies the fp32 accumulator by 2**28 (exact), then by the
A and W global scales (scalar or per row), then adds the bias, then casts.

K order: each BK=128 step splits into the 64 even-K elements (low nibbles) and the 64 odd ones (high
nibbles): two dots, acc = dot(a_lo, w_lo^T, acc); acc = dot(a_hi, w_hi^T, acc). Both operands use the same
permutation, so the sum is a @ w.T; the order (k16 pieces: evens of step 0, odds of step 0, evens of step 1,
...) is fixed for every tile shape, and there is no split-K: row i's bits do not depend on M.
K-chunk contract (KC > 0, ``gemm.k_chunk``): the same steps, but each KC-wide chunk of K is accumulated from
zero (part = dot(..., part)) and the chunk sums are added in chunk order, acc = acc + part, from acc = 0: the
order the CUDA decode kernel reproduces with chunks spread over warps. Still independent of M.
Grouped (MoE): one launch; axis 0 walks a device-side tile schedule (expert, first row) built without a host
sync; tiles past the real count exit at once. K-grouped (MoE wgrad, ``backward_gemm``): axis 1 is the expert,
whose K range is its own token segment (one fp32 chain over it), writing its own [M, N] output.
W_KSEG > 1 (dgrad through fused shards with their own global scales, ``backward_gemm``): K is W_KSEG equal
segments on whole BK steps, each summed from zero and added, in order, times its W global scale.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_pdl import pdl_wait
from ._triton_round import round_to

BK = 128  # K step, fixed for every config: part of the batch-invariance contract


@triton.jit
def _decode(c_ptrs, s_ptrs, cmask, smask):
    """Load [R, BK/16, 8] packed codes and [R, BK/16] scales -> (lo, hi) fp16 [R, BK/2], value*2**-14."""
    c = tl.load(c_ptrs, mask=cmask, other=0).to(tl.int32)
    s = tl.load(s_ptrs, mask=smask, other=0).to(tl.int32)
    sf = ((s << 7).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)[:, :, None]
    lo = (((c & 0x7) << 9) | ((c & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (((c & 0x70) << 5) | ((c & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    lo = (lo * sf).to(tl.float16)
    hi = (hi * sf).to(tl.float16)
    return (tl.reshape(lo, (lo.shape[0], lo.shape[1] * lo.shape[2])),
            tl.reshape(hi, (hi.shape[0], hi.shape[1] * hi.shape[2])))


@triton.jit
def _k_range(acc, k_begin, k_end, kp_end, a_c, a_s, w_c, w_s, a_h, w_h, rmask, nmask, j, ks, BK: tl.constexpr,
             A_F16: tl.constexpr, W_F16: tl.constexpr):
    """acc + the products of K [k_begin, k_end) (k_begin a multiple of BK), step after step in the K order
    above; A_F16 walks the pre-decoded form up to kp_end (its zero-padded end of the range)."""
    if A_F16:  # (implies W_F16) a plain fp16 GEMM over the pre-decoded K order, 64 columns a step:
        # the same sequence of k16 pieces as the two dots of the decode loop, in half the shared memory
        for kk in range(k_begin, kp_end, BK // 2):
            a16 = tl.load(a_h + kk, mask=rmask[:, None], other=0.0)
            w16 = tl.load(w_h + kk, mask=nmask[:, None], other=0.0)
            acc = tl.dot(a16, tl.trans(w16), acc)
    else:
        for k0 in range(k_begin, k_end, BK):
            kmask = (k0 // 16 + j) < ks
            a_lo, a_hi = _decode(a_c + k0 // 2, a_s + k0 // 16, rmask[:, None, None] & kmask[None, :, None],
                                 rmask[:, None] & kmask[None, :])
            if W_F16:
                w_lo = tl.load(w_h + k0, mask=nmask[:, None], other=0.0)
                w_hi = tl.load(w_h + (k0 + BK // 2), mask=nmask[:, None], other=0.0)
            else:
                w_lo, w_hi = _decode(w_c + k0 // 2, w_s + k0 // 16, nmask[:, None, None] & kmask[None, :, None],
                                     nmask[:, None] & kmask[None, :])
            acc = tl.dot(a_lo, tl.trans(w_lo), acc)
            acc = tl.dot(a_hi, tl.trans(w_hi), acc)
    return acc


@triton.jit
def _l2_tile(n_tiles_m, N, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a dense launch's 1D grid in grouped order: GROUP_M row tiles share each weight tile
    while it is in L2."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BN)
    width = GROUP_M * n_tiles_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % gsize, (pid % width) // gsize


@triton.jit
def _tile_index(row0, row_end, pid_n, N, BM: tl.constexpr, BN: tl.constexpr):
    """Rows / cols of the output tile, their masks and int64 forms (for address arithmetic)."""
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    return rows, cols, rows < row_end, cols < N, rows.to(tl.int64), cols.to(tl.int64)


@triton.jit
def nvfp4_mm_kernel(a_codes, a_scales, w_codes, w_scales, ga_ptr, gw_ptr, bias_ptr, out_ptr,
                    tile_expert_ptr, tile_row_ptr, offsets_ptr,
                    M, N, K, n_tiles_m,
                    w_estride_c, w_estride_s, gw_estride,
                    GA_ROW: tl.constexpr, GW_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                    GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr, A_F16: tl.constexpr = False, W_F16: tl.constexpr = False,
                    KC: tl.constexpr = 0, K_GROUPED: tl.constexpr = False, W_KSEG: tl.constexpr = 1,
                    PDL: tl.constexpr = False):
    pdl_wait(PDL)
    kh = K // 2
    ks = K // 16
    if K_GROUPED:  # axis 1: the group; its K segment [ends[g-1], ends[g]) from offsets_ptr; out [G, M, N]
        pid_m, pid_n = _l2_tile(n_tiles_m, N, BN, GROUP_M)
        g = tl.program_id(1)
        row0 = pid_m * BM
        row_end = M
        # the bounds are whole BK steps (the caller's contract): the hint keeps the loads 16-byte vectors
        k_lo = tl.multiple_of(tl.load(offsets_ptr + g - 1, mask=g > 0, other=0), BK)
        k_hi = tl.multiple_of(tl.load(offsets_ptr + g), BK)
        out_ptr += g.to(tl.int64) * M * N
    elif GROUPED:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(offsets_ptr + e + 1)
        w_codes += e.to(tl.int64) * w_estride_c
        w_scales += e.to(tl.int64) * w_estride_s
        gw_ptr += e.to(tl.int64) * gw_estride
    else:
        pid_m, pid_n = _l2_tile(n_tiles_m, N, BN, GROUP_M)
        row0 = pid_m * BM
        row_end = M
    rows, cols, rmask, nmask, rows64, cols64 = _tile_index(row0, row_end, pid_n, N, BM, BN)
    j = tl.arange(0, BK // 16)
    t = tl.arange(0, 8)
    h = tl.arange(0, BK // 2)
    kp = tl.cdiv(K, BK) * BK  # row stride of the pre-decoded fp16 form (``decode_f16_kernel``)
    jt = j[:, None] * 8 + t[None, :]  # byte offset inside the step, [BK/16, 8]
    a_c = a_codes + rows64[:, None, None] * kh + jt[None, :, :]
    w_c = w_codes + cols64[:, None, None] * kh + jt[None, :, :]
    a_s = a_scales + rows64[:, None] * ks + j[None, :]
    w_s = w_scales + cols64[:, None] * ks + j[None, :]
    a_h = a_codes + rows64[:, None] * kp + h[None, :]
    w_h = w_codes + cols64[:, None] * kp + h[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if K_GROUPED:  # (A_F16: segments on whole BK steps)
        acc = _k_range(acc, k_lo, k_hi, k_hi, a_c, a_s, w_c, w_s, a_h, w_h, rmask, nmask, j, ks, BK, A_F16, W_F16)
    elif W_KSEG > 1:  # W's global scale per K segment: each segment from zero, added times its scale
        seg = tl.multiple_of(K // W_KSEG, BK)  # whole BK steps (checked by the caller)
        for sg in tl.static_range(W_KSEG):
            part = _k_range(tl.zeros((BM, BN), dtype=tl.float32), sg * seg, (sg + 1) * seg, (sg + 1) * seg, a_c,
                            a_s, w_c, w_s, a_h, w_h, rmask, nmask, j, ks, BK, A_F16, W_F16)
            acc = acc + part * tl.load(gw_ptr + sg)
    elif KC == 0:
        acc = _k_range(acc, 0, K, kp, a_c, a_s, w_c, w_s, a_h, w_h, rmask, nmask, j, ks, BK, A_F16, W_F16)
    else:
        for c0 in range(0, K, KC):
            part = _k_range(tl.zeros((BM, BN), dtype=tl.float32), c0, tl.minimum(c0 + KC, K),
                            tl.minimum(c0 + KC, kp), a_c, a_s, w_c, w_s, a_h, w_h, rmask, nmask, j, ks, BK,
                            A_F16, W_F16)
            acc = acc + part
    out = acc * 268435456.0  # 2**28: the two 2**-14 decode factors
    if GA_ROW:
        out = out * tl.load(ga_ptr + rows, mask=rmask, other=0.0)[:, None]
    else:
        out = out * tl.load(ga_ptr)
    if GW_ROW:
        out = out * tl.load(gw_ptr + cols, mask=nmask, other=0.0)[None, :]
    elif W_KSEG == 1:
        out = out * tl.load(gw_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows64[:, None] * N + cols64[None, :]
    tl.store(o_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])  # RNE


@triton.jit
def _decode_step_rows(codes, scales, out, R, K, out_pitch, src0, blocks0, n_blocks, k0, BR: tl.constexpr,
                      BK: tl.constexpr):
    """Program axis 0's BR rows: the BK source columns from ``src0`` (16-blocks blocks0 + j real while below
    ``n_blocks``, the rest zero) -> out[:, k0 : k0 + BK] (row pitch ``out_pitch``): the step's even-K values,
    then its odd-K values, each e2m1 * scale * 2**-14 exactly."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    j = tl.arange(0, BK // 16)
    t = tl.arange(0, 8)
    h = tl.arange(0, BK // 2)
    kmask = (blocks0 + j) < n_blocks
    c_ptrs = codes + rows64[:, None, None] * (K // 2) + src0 // 2 + (j[:, None] * 8 + t[None, :])[None, :, :]
    s_ptrs = scales + rows64[:, None] * (K // 16) + src0 // 16 + j[None, :]
    lo, hi = _decode(c_ptrs, s_ptrs, rmask[:, None, None] & kmask[None, :, None], rmask[:, None] & kmask[None, :])
    o = out + rows64[:, None] * out_pitch + k0 + h[None, :]
    tl.store(o, lo, mask=rmask[:, None])
    tl.store(o + BK // 2, hi, mask=rmask[:, None])


@triton.jit
def decode_f16_kernel(codes, scales, out, R, K, BR: tl.constexpr, BK: tl.constexpr):
    """[R, K] NVFP4 -> fp16 [R, cdiv(K, BK) * BK] in the GEMM's K order: each BK step stores its even-K
    values, then its odd-K values (zero padded), each value e2m1 * scale * 2**-14 exactly."""
    k0 = tl.program_id(1) * BK
    _decode_step_rows(codes, scales, out, R, K, tl.cdiv(K, BK) * BK, k0, k0 // 16, K // 16, k0, BR, BK)


@triton.jit
def decode_f16_segments_kernel(codes, scales, ends_ptr, out, ends_out_ptr, R, K, KP, E, BR: tl.constexpr,
                               BK: tl.constexpr, BE: tl.constexpr, WRITE_ENDS: tl.constexpr):
    """``decode_f16_kernel`` for token segments (the MoE wgrad operands): [R, K] NVFP4 whose segment e is the
    columns [ends[e-1], ends[e]) (whole 16-blocks) -> fp16 [R, KP] where segment e starts on a BK step of its
    own and fills cdiv(len_e, BK) steps, each laid out as decode_f16_kernel lays out a step of that segment
    alone (its tail zero padded). Program axis 1 is the output step; steps past the last segment are left
    unwritten (never read). WRITE_ENDS: program (0, 0) writes those BK-aligned segment ends (int32 [E])."""
    e = tl.arange(0, BE)
    live = e < E
    hi_e = tl.load(ends_ptr + e, mask=live, other=0)
    lo_e = tl.load(ends_ptr + e - 1, mask=live & (e > 0), other=0)
    lens = hi_e - lo_e
    steps = tl.where(live, (lens + BK - 1) // BK * BK, 0)
    cends = tl.cumsum(steps, 0)
    if WRITE_ENDS:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(ends_out_ptr + e, cends.to(tl.int32), mask=live)
    k0 = tl.program_id(1) * BK
    seg = tl.sum(((cends <= k0) & live).to(tl.int32), 0)
    if seg >= E:
        return
    pick = e == seg
    local = k0 - tl.sum(tl.where(pick, cends - steps, 0), 0)
    src0 = tl.multiple_of(tl.sum(tl.where(pick, lo_e, 0), 0) + local, 16)
    n_blocks = (tl.sum(tl.where(pick, lens, 0), 0) - local) // 16
    _decode_step_rows(codes, scales, out, R, K, KP, src0, 0, n_blocks, k0, BR, BK)
