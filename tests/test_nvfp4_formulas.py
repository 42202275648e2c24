"""minite.nvfp4 against an independent scalar oracle, and the pinned differences between the formulas.

The oracle below is deliberately naive: one Python loop per element, numpy float32 scalars for every fp32
operation (so each op rounds once, exactly like the engines' fp32 tensor ops), E4M3 rounding done by hand
from the float's exponent (round-half-even on the exact quotient), E2M1 by nearest-grid-point search with
ties to the even code. It shares no code with the module under test.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from minite import nvfp4
from minite.nvfp4 import quantize, unpack_codes

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
SIXTH = F32(1.0 / 6.0)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ------------------------------------------------------------------------------------------------ oracle
def e4m3_round(v) -> float:
    """RNE of a non-negative fp32 value <= 448 onto float8_e4m3fn (bias 7, 3 mantissa bits, subnormal
    quantum 2**-9)."""
    a = float(v)
    assert 0.0 <= a <= 448.0, a
    if a == 0.0:
        return 0.0
    bits = struct.unpack("<I", struct.pack("<f", a))[0]
    e = ((bits >> 23) & 0xFF) - 127                  # a in [2**e, 2**(e+1)) (a is normal fp32 here or
    if (bits >> 23) & 0xFF == 0:                     # tiny: fp32 subnormals are far below 2**-10)
        e = -127
    quantum = 2.0 ** (max(e, -6) - 3)
    return round(a / quantum) * quantum              # a / quantum is exact; round() is half-to-even


def e4m3_bits(s: float) -> int:
    """Bit pattern of an exactly representable non-negative e4m3fn value."""
    if s == 0.0:
        return 0
    if s < 2.0 ** -6:
        return int(s / 2.0 ** -9)
    e = math.floor(math.log2(s))
    return ((e + 7) << 3) | int(s / 2.0 ** (e - 3) - 8)


def e2m1_code(v) -> int:
    """Nearest of the 8 magnitudes (ties -> even code), sign bit 3 set for v < 0 (also when it rounds to 0)."""
    a = abs(float(v))
    mag = min(range(8), key=lambda i: (abs(a - GRID[i]), i % 2))
    return mag | (8 if float(v) < 0 else 0)


def _clamp(v, lo, hi):
    return F32(min(max(v, F32(lo)), F32(hi)))


def _vllm_recip(t):
    return F32(1) / (t + (F32(1e8) if t == 0 else F32(0)))


def oracle(x, formula, tile=(1, 16), scaling="tensor", amax=None, G=None):
    """Codes [M, K] (ints), scales [M, K/16] (floats), S_dec per row [M] — one element at a time."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    codes = np.zeros((m, k), dtype=np.int64)
    scales = np.zeros((m, k // 16))
    sdec_rows = np.zeros(m, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for i in range(m):
            if scaling == "tensor":
                A = F32(np.max(np.abs(x)))
            elif scaling == "row":
                A = F32(np.max(np.abs(x[i])))
            else:
                A = F32(amax) if amax is not None else None
            for b in range(k // 16):
                if tuple(tile) == (16, 16):
                    r0 = (i // 16) * 16
                    blk = x[r0:r0 + 16, b * 16:(b + 1) * 16]
                else:
                    blk = x[i, b * 16:(b + 1) * 16]
                bam = F32(np.max(np.abs(blk)))
                if formula == "te":
                    senc = min(F32(2688) / A, FLT_MAX)
                    if A == 0 or senc == 0:
                        senc = F32(1)
                    sd = F32(1) / senc
                    mult = senc * SIXTH
                    s = e4m3_round(_clamp(min(bam * mult, FLT_MAX), -448, 448))
                    enc = min(F32(1) / (F32(s) * sd), FLT_MAX)
                    vals = [_clamp(x[i, j] * enc, -6, 6) for j in range(b * 16, b * 16 + 16)]
                elif formula == "vllm":
                    g = F32(G) if G is not None else _vllm_recip(A / F32(2688))
                    s = e4m3_round(_clamp(g * (bam * SIXTH), -448, 448))
                    sd = _vllm_recip(g)
                    enc = _vllm_recip(F32(s) * sd)
                    vals = [_clamp(x[i, j] * enc, -6, 6) for j in range(b * 16, b * 16 + 16)]
                else:  # modelopt
                    sd = A / F32(2688)
                    bsc = bam / (sd * F32(6)) if sd != 0 else F32(0)
                    if bsc == 0:
                        bsc = F32(1)
                    s = e4m3_round(_clamp(bsc, 2.0 ** -9, 448))
                    den = F32(s) * sd
                    vals = [_clamp(x[i, j] / den, -6, 6) if den != 0 else F32(0)
                            for j in range(b * 16, b * 16 + 16)]
                codes[i, b * 16:(b + 1) * 16] = [e2m1_code(v) for v in vals]
                scales[i, b] = s
            sdec_rows[i] = sd
    return codes, scales, sdec_rows


def module(x, formula, **kw):
    t = quantize(torch.as_tensor(np.asarray(x, np.float32)), formula, **kw)
    return (unpack_codes(t.codes).long().numpy(), t.scales.float().double().numpy(),
            t.row_global_scale().numpy(), t)
