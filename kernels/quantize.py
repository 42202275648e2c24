"""Fused Triton NVFP4 activation quantizer, bit-identical to ``minite.nvfp4.quantize`` for formula "te".

One program owns ROWS whole rows (padded to a power of two KP >= 256) in registers: row amax, block amax,
E4M3 block scale (RNE done on the fp32 bits, no fp8 types in the kernel), encode scale, E2M1 rounding (RNE
or the reference's counter hash), nibble packing. Row and static scaling read x once; tensor scaling takes
an amax pre-pass (torch). The optional 16-point RHT is its own pass (``_rht_kernel``: float64 products and
sum, one rounding to fp32, like the reference) whose fp32 output the quantizer then reads. Every division is ``div_rn`` (IEEE
round-to-nearest), matching torch's fp32 ``/``. Rows wider than MAX_KP (the MoE wgrad operands: K = all routed
tokens) are cut into CHUNK_KP-wide column programs (a second grid axis) when the scaling is tensor or static;
row scaling needs the whole row and falls back to the reference there. Other formulas / tiles fall back too.

``dequantize`` is the inverse for any 1x16 NVFP4Tensor: e2m1 x e4m3 (exact) then x global scale in fp32, the
same two roundings as ``minite.nvfp4.dequantize``, optionally cast to BF16 (RNE) in the same pass.
"""
from __future__ import annotations

import torch

from minite import nvfp4 as ref

from . import _backend

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = None

_FLT_MAX_PY = 3.4028234663852886e38
MAX_KP = 32768    # widest row one program holds in registers
CHUNK_KP = 8192   # column width of one program for wider rows (tensor / static scaling)


if triton is not None:
    _FLT_MAX = tl.constexpr(_FLT_MAX_PY)  # jit code reads globals only as constexpr

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
        # the sign as a bit: Triton 3.6 lowers unary minus to 0 - x, which turns code 8 into +0.0, not -0.0
        val = (mag.to(tl.uint32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
        sb = tl.load(scales_ptr + b, mask=bmask, other=0).to(tl.uint32)  # e4m3 bits, decoded exactly
        e, man = (sb >> 3) & 0xF, sb & 7
        s_norm = (((e + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        s_sub = man.to(tl.float32) * 0.001953125  # 2**-9
        sc = tl.where(e == 0, s_sub, s_norm)
        sc = (sc.to(tl.uint32, bitcast=True) | ((sb & 0x80) << 24)).to(tl.float32, bitcast=True)
        if ROW_G:
            g = tl.load(g_ptr + b // blocks_per_row, mask=bmask, other=1.0)
        else:
            g = tl.load(g_ptr + b * 0, mask=bmask, other=1.0)
        y = (val * sc[:, None]) * g[:, None]
        if OUT_BF16:  # RNE on the fp32 bits (values are finite): the interpreter's bf16 cast truncates
            bits = y.to(tl.uint32, bitcast=True)
            y = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(y_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], y, mask=bmask[:, None])


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
    """minite.nvfp4.rht16 (float64 accumulation, one rounding to fp32) as one Triton pass: [M, K] -> fp32."""
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
    """``minite.nvfp4.quantize`` (same signature, same bits) through the fused Triton kernel where it applies:
    formula "te", tile (1, 16), K <= 32768; everything else (and backend="torch") runs the reference."""
    ref._validate(x, formula, tile, scaling, amax, global_encode_scale, rounding, rht, generator)
    kw = dict(formula=formula, tile=tile, scaling=scaling, amax=amax, global_encode_scale=global_encode_scale,
              rounding=rounding, rht=rht, generator=generator, check=check)
    if (formula != "te" or tuple(tile) != (1, 16) or (x.shape[1] > MAX_KP and scaling == "row")
            or _backend.resolve(backend, x.device) != "triton"):
        return ref.quantize(x, **kw)
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


def dequantize(t: ref.NVFP4Tensor, out_dtype: torch.dtype = torch.float32,
               backend: str | None = None) -> torch.Tensor:
    """``minite.nvfp4.dequantize(t).to(out_dtype)`` bit for bit, in one Triton pass on the GPU (out_dtype
    float32 or bfloat16); CPU tensors (and backend="torch") run the reference."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize: out_dtype must be float32 or bfloat16, got {out_dtype}")
    codes = t.codes
    if _backend.resolve(backend, codes.device) != "triton" or codes.dim() != 2:
        return ref.dequantize(t).to(out_dtype)
    m, k = t.shape
    g = t.global_scale.to(torch.float32).contiguous()
    y = torch.empty(m, k, dtype=out_dtype, device=codes.device)
    n_blocks = m * (k // ref.BLOCK)
    blk = 128
    if n_blocks:
        _dequant_kernel[(triton.cdiv(n_blocks, blk),)](
            codes.contiguous(), t.scales.view(torch.uint8).contiguous(), g,
            y.view(torch.int16) if out_dtype == torch.bfloat16 else y, n_blocks, k // ref.BLOCK,
            BLK=blk, ROW_G=g.dim() == 1 and g.numel() > 1, OUT_BF16=out_dtype == torch.bfloat16, num_warps=4)
    return y
