"""The quantizer path before the fused kernels (code as of b4b6a1c), kept only as the baseline that
``quantize_bench`` times side by side with the fused kernels: a separate float64 RHT pass, a torch amax
pre-pass, whole-row / column-chunked cast programs, and the trainer's old PyTorch weight quantizer. Not used
by the product; its RHT predates the BF16 rounding of TE's semantics (timing only, never checked for bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite import nvfp4 as ref

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
MAX_KP = 32768
CHUNK_KP = 8192


@triton.jit
def _hash32(x):
    # minite.nvfp4._hash32 on uint32 (the multiplies wrap mod 2**32 exactly like the int64 & mask form)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x297A2D39
    return x ^ (x >> 16)

@triton.jit
def _rht_kernel(x_ptr, y_ptr, h_ptr, n_blocks, BLK: tl.constexpr):
    """y[b, :] = fp32(sum_i float64(x[b, i]) * H[i, :]) for BLK blocks of 16: elementwise products and a
    float64 sum (no fp64 dot: Triton 3.6's fp64 MMA rejects K=16 on sm_90)."""
    b = tl.program_id(0) * BLK + tl.arange(0, BLK)
    i = tl.arange(0, 16)
    bmask = b < n_blocks
    x = tl.load(x_ptr + b.to(tl.int64)[:, None] * 16 + i[None, :], mask=bmask[:, None], other=0.0)
    h = tl.load(h_ptr + i[:, None] * 16 + i[None, :])  # float64 diag(sign) @ H16 / 4
    y = tl.sum(x.to(tl.float64)[:, :, None] * h[None, :, :], axis=1)
    tl.store(y_ptr + b.to(tl.int64)[:, None] * 16 + i[None, :], y.to(tl.float32), mask=bmask[:, None])

@triton.jit(do_not_specialize=["seed"])
def _te_quant_kernel(x_ptr, codes_ptr, scales_ptr, sdec_ptr, amax_ptr, bad_ptr,
                     M, K, stride_x, seed,
                     ROWS: tl.constexpr, KP: tl.constexpr, ROW_SCALING: tl.constexpr,
                     STOCHASTIC: tl.constexpr):
    pid = tl.program_id(0)
    pc = tl.program_id(1)  # column chunk (always 0 when a program holds whole rows)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = pc * KP + tl.arange(0, KP)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    # NaN/Inf flag per program (the caller raises) instead of a second pass; with RHT x is already the
    # transformed tensor, which propagates a bad input and can itself overflow (the reference checks both)
    badv = ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    tl.store(bad_ptr + pid * tl.num_programs(1) + pc, tl.sum(tl.sum(badv, axis=1), axis=0))
    ax = tl.abs(x)
    if ROW_SCALING:
        amax = tl.max(ax, axis=1)  # [ROWS]
    else:
        amax = tl.load(amax_ptr + rows * 0)
    # S_enc = min(2688 / amax, FLT_MAX), 1 where amax == 0 or S_enc == 0; S_dec = 1 / S_enc
    s_enc = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), _FLT_MAX)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
    mult = s_enc * 0.16666666666666666  # S_enc * fp32(1/6), formed first
    if ROW_SCALING:
        tl.store(sdec_ptr + rows, s_dec, mask=rmask)
    # block scales: e4m3(clamp(block_amax * mult, <= 448)), rounded to nearest-even on fp32 bits
    bamax = tl.max(tl.reshape(ax, (ROWS, KP // 16, 16)), axis=2)
    sv = tl.minimum(tl.minimum(bamax * mult[:, None], _FLT_MAX), 448.0)
    bits = sv.to(tl.uint32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    s_norm = rb.to(tl.float32, bitcast=True)
    code_norm = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    s_sub = (sv + 16384.0) - 16384.0  # RNE onto the 2**-9 subnormal grid
    code_sub = (s_sub * 512.0).to(tl.uint32)
    is_norm = sv >= 0.015625
    s_q = tl.where(is_norm, s_norm, s_sub)
    s_code = tl.where(is_norm, code_norm, code_sub).to(tl.uint8)
    scols = pc * (KP // 16) + tl.arange(0, KP // 16)
    smask = rmask[:, None] & (scols[None, :] < K // 16)
    tl.store(scales_ptr + rows[:, None].to(tl.int64) * (K // 16) + scols[None, :], s_code, mask=smask)
    enc = tl.minimum(tl.math.div_rn(tl.full(s_q.shape, 1.0, tl.float32), s_q * s_dec[:, None]), _FLT_MAX)
    v = tl.reshape(x, (ROWS, KP // 16, 16)) * enc[:, :, None]
    v = tl.reshape(tl.minimum(tl.maximum(v, -6.0), 6.0), (ROWS, KP))
    a = tl.abs(v)
    if STOCHASTIC:
        lo = ((a >= 0.5).to(tl.uint32) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0)
              + (a >= 4.0) + (a >= 6.0))
        lo_val = tl.where(lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo < 7, lo.to(tl.float32) - 2.0, 6.0))
        inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
        frac = (a - lo_val) * inv_step
        idx = (rows[:, None].to(tl.int64) * K + cols[None, :]).to(tl.uint32)
        hsh = _hash32(_hash32(idx) ^ seed.to(tl.uint32))
        u = (hsh >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        mag = lo + ((u < frac) & (lo < 7)).to(tl.uint32)
    else:
        mag = ((a > 0.25).to(tl.uint32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
               + (a >= 3.5) + (a > 5.0))
    code = mag | ((v < 0).to(tl.uint32) << 3)
    even, odd = tl.split(tl.reshape(code, (ROWS, KP // 2, 2)))
    packed = (even | (odd << 4)).to(tl.uint8)
    pcols = pc * (KP // 2) + tl.arange(0, KP // 2)
    pmask = rmask[:, None] & (pcols[None, :] < K // 2)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], packed, mask=pmask)



def _layout(k: int) -> tuple[int, int, int, int]:
    """(ROWS, KP, num_warps, column chunks): about 8K elements per program; rows wider than MAX_KP in
    CHUNK_KP-wide pieces."""
    kp = max(256, triton.next_power_of_2(k)) if k <= MAX_KP else CHUNK_KP
    rows = max(1, 8192 // kp)
    warps = 4 if kp <= 4096 else (8 if kp <= 16384 else 16)
    return rows, kp, warps, triton.cdiv(k, kp)


def _launch(x, codes, scales, sdec, amax, bad, seed, row_scaling, stochastic):
    m, k = x.shape
    rows, kp, warps, chunks = _layout(k)
    assert chunks == 1 or not row_scaling, "row scaling needs whole rows"
    _te_quant_kernel[(triton.cdiv(m, rows), chunks)](x, codes, scales, sdec, amax, bad, m, k, x.stride(0), seed,
                                                     ROWS=rows, KP=kp, ROW_SCALING=row_scaling,
                                                     STOCHASTIC=stochastic, num_warps=warps)


def rht16(x: torch.Tensor) -> torch.Tensor:
    """The old RHT pass: float64 products and sum, one rounding to fp32, written out: [M, K] -> fp32."""
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n_blocks = x.numel() // ref.BLOCK
    blk = 64
    if n_blocks:
        _rht_kernel[(triton.cdiv(n_blocks, blk),)](x, y, ref.rht_matrix(x.device).contiguous(), n_blocks,
                                                   BLK=blk, num_warps=4)
    return y


def quantize(x: torch.Tensor, formula: str = "te", tile=(1, 16), scaling: str = "tensor", amax=None,
             global_encode_scale=None, rounding: str = "nearest", rht: bool = False,
             generator: torch.Generator | None = None, check: bool = True,
             backend: str | None = None) -> ref.NVFP4Tensor:
    """The old kernels.quantize for formula "te", 1x16 (the only calls the bench makes)."""
    m, k = x.shape
    dev = x.device
    if rht:  # one extra pass (the fused form needs an fp64 dot that Triton 3.6 cannot build on sm_90)
        x = rht16(x)
    elif x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(m, k // 16, dtype=torch.float8_e4m3fn, device=dev)
    rows, _, _, chunks = _layout(k)
    bad = torch.zeros(max(1, triton.cdiv(m, rows) * chunks), dtype=torch.int32, device=dev)
    sdec_row = torch.empty(m, dtype=torch.float32, device=dev)
    if scaling == "row":
        amax_t = sdec_row  # unused
    elif scaling == "static":
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=dev).reshape(1)
        if check:
            ref.check_finite(amax_t, "amax")
    else:  # tensor scaling: the amax pre-pass (of the transformed values when rht)
        amax_t = x.abs().amax().to(torch.float32).reshape(1)
    if rounding == "stochastic":  # the reference's one draw, from the same generator
        g = generator if generator is not None else torch.default_generator
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g, device=g.device).item())
    else:
        seed = 0
    _launch(x, codes, scales.view(torch.uint8), sdec_row, amax_t, bad, seed, scaling == "row",
            rounding == "stochastic")
    if check and bool(bad.any()):
        raise ValueError("NVFP4 quantize: input contains NaN or Inf; refusing to produce codes")
    if scaling == "row":
        s_dec = sdec_row
    else:  # scalar global: the same torch ops as the reference (bit-identical by construction)
        s_dec = ref._te_global(amax_t.reshape(()))[1]
    return ref.NVFP4Tensor(codes, scales, s_dec.to(torch.float32).contiguous())



def quantize_weight_groups(w: torch.Tensor, tile, shards: int):
    """The trainer's old weight path for w [G, N, K]: NaN check, vectorised PyTorch quantization with one
    amax per (group, shard), then the BF16 values (quant_linear.quantize_weight as of b4b6a1c)."""
    ref.check_finite(w, "weight")
    g, n, k = w.shape
    x = w.to(torch.float32)
    amax = x.abs().view(g, shards, n // shards, k).amax(dim=(2, 3))
    s_enc, s_dec = ref._te_global(amax)
    s_enc = s_enc.repeat_interleave(n // shards, dim=1)
    s_dec = s_dec.repeat_interleave(n // shards, dim=1)
    if tuple(tile) == (16, 16):
        bamax = x.abs().view(g, n // 16, 16, k // 16, 16).amax(dim=(2, 4)).repeat_interleave(16, dim=1)
    else:
        bamax = x.abs().view(g, n, k // 16, 16).amax(dim=-1)
    mult = s_enc * torch.tensor(1.0 / ref.FP4_MAX, dtype=torch.float32, device=w.device)
    s = torch.clamp(torch.clamp(bamax * mult[..., None], max=ref.FLT_MAX), -ref.E4M3_MAX, ref.E4M3_MAX)
    s = s.to(torch.float8_e4m3fn)
    enc = torch.clamp(1.0 / (s.to(torch.float32) * s_dec[..., None]), max=ref.FLT_MAX)
    v = torch.clamp(x.view(g, n, k // 16, 16) * enc[..., None], -ref.FP4_MAX, ref.FP4_MAX).view(g * n, k)
    codes4 = ref._rne_e2m1_magnitude(v.abs()) | ((v < 0).to(torch.uint8) << 3)
    codes = ref.pack_codes(codes4).view(g, n, k // 2)
    vals = ref.e2m1_decode(ref.unpack_codes(codes.view(g * n, k // 2))).view(g, n, k // 16, 16)
    dq = ((vals * s.to(torch.float32)[..., None]).view(g, n, k) * s_dec[..., None]).to(torch.bfloat16)
    return codes, s, s_dec, dq
