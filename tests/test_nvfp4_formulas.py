"""minite.nvfp4 against an independent scalar oracle, and the pinned differences between the formulas.

The oracle below is deliberately naive: one Python loop per element, numpy float32 scalars for every fp32
operation (so each op rounds once, exactly like the engines' fp32 tensor ops), E4M3 rounding done by hand
from the float's exponent (round-half-even on the exact quotient), E2M1 by nearest-grid-point search with
ties to the even code. It shares no code with the module under test.
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ------------------------------------------------------------------------------------- oracle self-checks
def test_oracle_e4m3_agrees_with_torch_cast_and_bits():
    """Every positive e4m3fn value, the midpoints between neighbours and one fp32 ulp either side."""
    vals = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert [e4m3_bits(v) for v in vals] == list(range(1, 127)) and vals[-1] == 448.0
    probes = [0.0, 2.0 ** -10, 2.0 ** -11] + vals
    for a, b in zip([0.0] + vals, vals, strict=False):
        mid = np.float32((a + b) / 2)
        probes += [float(mid), float(np.nextafter(mid, F32(0))), float(np.nextafter(mid, F32(500)))]
    probes = [p for p in probes if p <= 448.0]
    got = torch.tensor(probes, dtype=torch.float32).to(torch.float8_e4m3fn).float().tolist()
    assert got == [e4m3_round(p) for p in probes]


def test_oracle_e2m1_ties():
    assert [e2m1_code(v) for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)] == [0, 2, 2, 4, 4, 6, 6]
    assert [e2m1_code(v) for v in (-0.25, -0.0, 0.0, -6.0)] == [8, 0, 0, 15]


# ------------------------------------------------------------------------------- module == oracle, bitwise
def _agree(x, formula, **kw):
    okw = {k: v for k, v in kw.items() if k in ("tile", "scaling", "amax")}
    if "global_encode_scale" in kw:
        okw["G"] = kw["global_encode_scale"]
    c, s, g, t = module(x, formula, **kw)
    oc, os_, og = oracle(x, formula, **okw)
    assert np.array_equal(c, oc), (formula, kw, np.argwhere(c != oc)[:5])
    assert np.array_equal(s, os_), (formula, kw, np.argwhere(s != os_)[:5])
    assert np.array_equal(g, og), (formula, kw, g, og)
    bits = t.scales.view(torch.uint8).numpy()
    assert [[e4m3_bits(v) for v in r] for r in s.tolist()] == bits.tolist()


CONFIGS = [dict(), dict(scaling="row"), dict(tile=(16, 16)), dict(scaling="static", amax=0.5)]


@pytest.mark.parametrize("formula", ["te", "vllm", "modelopt"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["tensor", "row", "tile16x16", "static_clip"])
def test_module_matches_oracle_random(formula, cfg):
    """bf16 data over 16 decades per row, zero blocks, a denormal-scale row: every code, scale and S_dec."""
    rng = np.random.default_rng(zlib.crc32(f"{formula} {cfg}".encode()))  # stable: a failure replays
    for _ in range(3):
        m = 16 if "tile" in cfg else int(rng.integers(1, 5))
        x = rng.standard_normal((m, 48)) * np.exp(rng.uniform(-18, 18, (m, 1)))
        x[rng.random((m, 48)) < 0.1] = 0
        x[:, 16:32] *= 1e-7  # blocks far below the row's amax: subnormal / underflowing scales
        x = torch.from_numpy(x.astype(np.float32)).bfloat16().float().numpy()
        kw = dict(cfg)
        if kw.get("scaling") == "static":
            kw["amax"] = float(np.float32(np.abs(x).max() * 0.5))  # half the data clips
            if formula == "vllm":
                kw["global_encode_scale"] = float(np.float32(2688) / np.float32(kw.pop("amax")))
        _agree(x, formula, **kw)


@st.composite
def small_matrices(draw):
    m, nb = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    vals = draw(st.lists(st.floats(-448.0, 448.0, width=32), min_size=m * nb * 16, max_size=m * nb * 16))
    x = np.array(vals, dtype=np.float32).reshape(m, nb * 16) * np.float32(2.0 ** draw(st.integers(-40, 40)))
    return x


@settings(max_examples=40, deadline=None, derandomize=True)
@given(small_matrices(), st.sampled_from(["te", "vllm", "modelopt"]), st.sampled_from(["tensor", "row"]))
def test_module_matches_oracle_hypothesis(x, formula, scaling):
    _agree(x, formula, scaling=scaling)


# ----------------------------------------------------------------- where the three formulas disagree
# Each row: [A, 0 x 15 | B, C, 0 x 14]. A is the tensor amax (block 0 gets scale 448 in every formula),
# B the amax of block 1, C the element that rounds differently. Found by searching 400k random bf16 rows
# (module and the oracle above agree on every entry); expected values are literal.
H = float.fromhex  # fp32 S_dec values, written exactly
PINNED = {
    # TE forms S_enc * (1/6) first: S_enc = 2688/6 = 448, fl(448 * fl(1/6)) = 74.66667175, and
    # fl(4.5 * 74.66667175) = 336.00003 lies above the 320|352 midpoint 336 -> 352. ModelOpt's
    # 4.5 / fl(6 * fl(6/2688)) = 335.99997 and vLLM's G * 0.75 = 447.99997 * 0.75 = 335.99998 fall below -> 320.
    "scale_te_vs_both": ((6.0, 4.5, 0.71875), {
        "te": ([448.0, 352.0], [7, 7, 2], H("0x1.24924ap-9")),
        "vllm": ([448.0, 320.0], [7, 7, 2], H("0x1.24924ap-9")),
        "modelopt": ([448.0, 320.0], [7, 7, 2], H("0x1.24924ap-9"))}),
    # Same scale 48 everywhere; den = fl(48 * S_dec) = 0.10714287. TE/vLLM: fl(1/den) = 9.333333015 and
    # 0.375 * 9.333333015 = 3.49999988 (exactly halfway between two fp32) -> 3.5 -> the E2M1 tie -> 4.0.
    # ModelOpt divides: 0.375 / den = 3.4999998 -> 3.0.
    "code_division_vs_reciprocal": ((6.0, 0.640625, 0.375), {
        "te": ([448.0, 48.0], [7, 7, 6], H("0x1.24924ap-9")),
        "vllm": ([448.0, 48.0], [7, 7, 6], H("0x1.24924ap-9")),
        "modelopt": ([448.0, 48.0], [7, 7, 5], H("0x1.24924ap-9"))}),
    # TE's S_dec = 1/fl(2688/A) is one ulp below A/2688 (vLLM's recip(G) and ModelOpt's weight_scale_2);
    # that ulp moves -1.6640625 across the 1.75 tie: -2.0 in TE, -1.5 in the others.
    "code_sdec_ulp": ((6.65625, 5.65625, -1.6640625), {
        "te": ([448.0, 384.0], [7, 7, 12], H("0x1.449248p-9")),
        "vllm": ([448.0, 384.0], [7, 7, 11], H("0x1.44924ap-9")),
        "modelopt": ([448.0, 384.0], [7, 7, 11], H("0x1.44924ap-9"))}),
    # vLLM multiplies G * fl(B * fl(1/6)) in that order; TE and ModelOpt land on 384, vLLM on 416.
    "scale_vllm_vs_both": ((3.5, 3.125, 0.33984375), {
        "te": ([448.0, 384.0], [7, 7, 1], H("0x1.555556p-10")),
        "vllm": ([448.0, 416.0], [7, 7, 1], H("0x1.555556p-10")),
        "modelopt": ([448.0, 384.0], [7, 7, 1], H("0x1.555556p-10"))}),
    # A block 2.7e6 times below the amax: its scale underflows. TE: scale 0, enc = min(1/0, FLT_MAX), codes
    # saturate to +-6 (decoding to 0); vLLM: scale 0, enc = recip(0) = 1e-8, codes 0 / -0; ModelOpt:
    # scale floored at 2**-9, 0.001 / 2**-9 = 0.512 -> 0.5 and -0.256 -> -0.5. All three differ.
    # ModelOpt divides by the formed divisor: b = 1.453125 / fl(6 * fl(1.9375/2688)) = 336.00003 -> 352
    # (multiplying by its reciprocal would give 336.0, the tie -> 320, which is what TE and vLLM get).
    "scale_modelopt_division": ((1.9375, 1.453125, -0.59765625), {
        "te": ([448.0, 320.0], [7, 7, 13], H("0x1.79e79ep-11")),
        "vllm": ([448.0, 320.0], [7, 7, 13], H("0x1.79e79ep-11")),
        "modelopt": ([448.0, 352.0], [7, 7, 12], H("0x1.79e79ep-11"))}),
    # All three agree here, but only because they all form enc = 1/(s * S_dec): fl(1/fl(320 * S_dec)) =
    # 3.7333333 and 0.46875 * 3.7333333 = 1.75 exactly -> the tie -> 2.0. The "same" S_enc / s = 3.7333331
    # gives 1.7499999 -> 1.5 (TE's bf16 fast path uses that form; its fp32 path and reference do not).
    "order_enc_reciprocal": ((2.25, 1.5546875, 0.46875), {
        "te": ([448.0, 320.0], [7, 7, 4], H("0x1.b6db6ep-11")),
        "vllm": ([448.0, 320.0], [7, 7, 4], H("0x1.b6db6ep-11")),
        "modelopt": ([448.0, 320.0], [7, 7, 4], H("0x1.b6db6ep-11"))}),
    "underflow_all_differ": ((2688.0, 0.001, -0.0005), {
        "te": ([448.0, 0.0], [7, 7, 15], 1.0),
        "vllm": ([448.0, 0.0], [7, 0, 8], 1.0),
        "modelopt": ([448.0, 2.0 ** -9], [7, 1, 9], 1.0)}),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned_formula_differences(name):
    (a, b, c), want = PINNED[name]
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, 0], x[0, 16], x[0, 17] = a, b, c
    for formula, (scales, codes, sdec) in want.items():
        cm, sm, gm, _ = module(x, formula)
        assert sm[0].tolist() == scales, (formula, sm)
        assert cm[0, [0, 16, 17]].tolist() == codes, (formula, cm[0])
        assert cm[0, 1:16].sum() == 0 and cm[0, 18:].sum() == 0
        assert gm[0] == np.float32(sdec), (formula, float(gm[0]).hex())
        oc, os_, og = oracle(x, formula)  # and the oracle says the same
        assert np.array_equal(cm, oc) and np.array_equal(sm, os_) and np.array_equal(gm, og)
    outcomes = {f: (tuple(w[0]), tuple(w[1])) for f, w in want.items()}
    assert len(set(outcomes.values())) >= (1 if name.startswith("order_") else 2)  # the point of the case


# --------------------------------------------------------------- te vs modelopt on random bf16 weights
# Measured with this module (CPU, torch 2.13, numpy 2.4 default_rng), weights N(0, 0.02) [256, 4096] bf16.
# The disagreement is a per-tensor lottery decided by the tensor amax: when 2688/amax makes block amaxes
# land on or next to E4M3 rounding midpoints, ~1-2% of scales differ; otherwise none do, and only the
# division-vs-reciprocal codes differ. Over seeds 0..99: codes differ in 0.078% on average (median 0.012%,
# max 0.44%); scales differ in 14 of 100 tensors (0.175% on average, max 1.72%). The issue's "~0.3% of codes
# and ~0.7% of scales" is one draw of that lottery. Three pinned draws (codes of 1,048,576; scales of 65,536):
#   seed  7 (amax 0.09912109375): codes 1591 (0.152%), scales    0 (0%)
#   seed 13 (amax 0.095703125):   codes 2786 (0.266%), scales 1088 (1.660%)
#   seed 25 (amax 0.09375):       codes 3869 (0.369%), scales  724 (1.105%)
@pytest.mark.parametrize("seed,n_codes,n_scales", [(7, 1591, 0), (13, 2786, 1088), (25, 3869, 724)])
def test_te_vs_modelopt_on_random_bf16_weights(seed, n_codes, n_scales):
    w = np.random.default_rng(seed).standard_normal((256, 4096)) * 0.02
    w = torch.from_numpy(w.astype(np.float32)).bfloat16()
    te, mo = quantize(w, "te"), quantize(w, "modelopt")
    assert int((unpack_codes(te.codes) != unpack_codes(mo.codes)).sum()) == n_codes
    assert int((te.scales.view(torch.uint8) != mo.scales.view(torch.uint8)).sum()) == n_scales
    # where they disagree it is by one grid step or one E4M3 step, never more
    d = (nvfp4.dequantize(te) - nvfp4.dequantize(mo)).abs()
    assert (d <= 2 * te.scales.float().repeat_interleave(16, 1) * te.global_scale * 1.01 + 1e-12).all()
