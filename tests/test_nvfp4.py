"""minite.nvfp4: hand-worked cases (every tie, zero blocks, saturation, subnormal scales, tiles, row and
static scaling), RHT, stochastic rounding, properties, bad input, dequantize and the GEMM oracle.

The bit-exact comparison against an independent per-element re-implementation, and the inputs on which the
three formulas disagree, live in test_nvfp4_formulas.py.

Most hand cases use an "identity" setup in which every formula's effective encode scale is exactly 1, so the
element value fed to the E2M1 rounding is x itself: te with static amax 2688 (S_enc = 2688/2688 = 1), vllm
with G = 1, modelopt with static amax 2688 (weight_scale_2 = 1); each 16-block holds a 6, so
block_amax * fl(1/6) = fl(6 * 0.16666667163) = fl(1.0000000298) = 1.0 and the block scale is exactly 1.
"""
from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minite import nvfp4
from minite.nvfp4 import (
    E2M1_VALUES,
    NVFP4Tensor,
    dequantize,
    nvfp4_matmul_reference,
    pack_codes,
    quantize,
    rht16,
    rht_matrix,
    stochastic_uniform,
    unpack_codes,
)

FORMULAS = ("te", "vllm", "modelopt")
IDENTITY = {"te": dict(scaling="static", amax=2688.0), "vllm": dict(scaling="static", global_encode_scale=1.0),
            "modelopt": dict(scaling="static", amax=2688.0)}
HYP = settings(max_examples=40, deadline=None, derandomize=True)


def codes_of(t: NVFP4Tensor) -> list[list[int]]:
    return unpack_codes(t.codes).tolist()


def below(v):  # next fp32 toward zero / away from zero
    return float(np.nextafter(np.float32(v), np.float32(0)))


def above(v):
    return float(np.nextafter(np.float32(v), np.float32(np.sign(v) * 100)))


# ------------------------------------------------------------------------------------------ E2M1 rounding
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
TIE_CODES = [0, 2, 2, 4, 4, 6, 6]          # -> 0, 1, 1, 2, 2, 4, 4: the even code of the two neighbours
BELOW_CODES = [0, 1, 2, 3, 4, 5, 6]        # one ulp toward zero: the lower neighbour
ABOVE_CODES = [1, 2, 3, 4, 5, 6, 7]        # one ulp away from zero: the upper neighbour


@pytest.mark.parametrize("formula", FORMULAS)
@pytest.mark.parametrize("shift,expect", [(lambda v: v, TIE_CODES), (below, BELOW_CODES), (above, ABOVE_CODES)],
                         ids=["tie", "ulp_below", "ulp_above"])
def test_e2m1_ties_both_signs(formula, shift, expect):
    row = [6.0] + [shift(v) for v in TIES] + [shift(-v) for v in TIES] + [-6.0]
    t = quantize(torch.tensor([row]), formula, **IDENTITY[formula])
    assert t.scales.float().tolist() == [[1.0]] and t.row_global_scale().tolist() == [1.0]
    assert codes_of(t) == [[7] + expect + [c + 8 for c in expect] + [15]]


@pytest.mark.parametrize("formula", FORMULAS)
def test_grid_points_and_signed_zero(formula):
    row = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    t = quantize(torch.tensor([row]), formula, **IDENTITY[formula])
    # -0.0 is not < 0: code 0 (TE's cast_to_fp4x2 and ModelOpt's sign bit agree); a tiny negative is code 8
    assert codes_of(t) == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]]
    assert dequantize(t).tolist() == [[abs(v) if v == 0 else v for v in row]]
    t = quantize(torch.tensor([[6.0, -0.1, 0.1, -0.25] + [0.0] * 12]), formula, **IDENTITY[formula])
    assert codes_of(t)[0][:4] == [7, 8, 0, 8]


# ----------------------------------------------------------------------------------- zero blocks, amax 0
def test_zero_blocks_per_formula():
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-3, 3, 16)
    x[1, 16:] = -0.0
    want_scale = {"te": 0.0, "vllm": 0.0, "modelopt": 1.0}  # TE/vLLM: no floor; ModelOpt: b == 0 -> 1
    for f in FORMULAS:
        t = quantize(x, f)
        s = t.scales.float()
        assert s[0, 0] == 448.0 and s[0, 1] == s[1, 0] == s[1, 1] == want_scale[f], f
        assert all(c == 0 for c in codes_of(t)[1]) and all(c == 0 for c in codes_of(t)[0][16:]), f
        assert torch.equal(dequantize(t)[:, 16:], torch.zeros(2, 16)), f


def test_all_zero_tensor():
    x = torch.zeros(3, 32)
    te = quantize(x, "te")     # CUDA rule: amax == 0 -> S_enc = 1
    assert te.global_scale.item() == 1.0 and te.scales.float().abs().sum() == 0
    vl = quantize(x, "vllm")   # G = recip(0 / 2688) = 1/1e8; S_dec = recip(G)
    g = np.float32(1) / np.float32(1e8)
    assert vl.global_scale.item() == float(np.float32(1) / g) and vl.scales.float().abs().sum() == 0
    mo = quantize(x, "modelopt")  # weight_scale_2 = 0, scales 1 (ModelOpt itself would give NaN scales)
    assert mo.global_scale.item() == 0.0 and (mo.scales.float() == 1).all()
    for t in (te, vl, mo):
        assert unpack_codes(t.codes).sum() == 0 and torch.equal(dequantize(t), x)
    rows = quantize(torch.cat([torch.ones(1, 16), torch.zeros(1, 16)]), "te", scaling="row")
    assert rows.global_scale.tolist() == [float(np.float32(1) / np.float32(2688)), 1.0]


# ------------------------------------------------------------------------------ e4m3 scale edge cases
def test_e4m3_saturation_clamps_not_nan():
    # S_enc = 1: block amax 3000 -> 3000 * fl(1/6) = 500.00001 -> clamped to 448 (a raw cast may give NaN)
    x = torch.tensor([[3000.0, 2820.0, 1000.0, -2000.0] + [0.0] * 12])
    t = quantize(x, "te", scaling="static", amax=2688.0)
    assert t.scales.float().item() == 448.0 and t.scales.view(torch.uint8).item() == 0x7E
    assert codes_of(t) == [[7, 7, 4, 14] + [0] * 12]  # 3000/448 = 6.7 -> clip; 1000/448 = 2.23; -4.46
    # dynamic: the block holding the tensor amax gives fl(amax * fl(S_enc/6)) = 448.00003 -> 448
    for f in FORMULAS:
        assert quantize(torch.tensor([[3.0] + [1.0] * 15]), f).scales.float().item() == 448.0


SUBNORMAL_CASES = [  # block amax, with S_enc = 1: scale = e4m3(fl(amax * fl(1/6)))
    (6 * 2.0 ** -6, 2.0 ** -6, 0x08),        # smallest normal
    (6 * 7 * 2.0 ** -9, 7 * 2.0 ** -9, 0x07),  # largest subnormal
    (6 * 2.0 ** -9, 2.0 ** -9, 0x01),        # smallest subnormal
    (6 * 1.5 * 2.0 ** -9, 2.0 ** -8, 0x02),  # tie 1.5 q -> even 2 q
    (6 * 2.5 * 2.0 ** -9, 2.0 ** -8, 0x02),  # tie 2.5 q -> even 2 q
    (6 * 0.5 * 2.0 ** -9, 0.0, 0x00),        # tie 0.5 q -> 0: a non-zero block with scale 0
    (0.0059, 2.0 ** -9, 0x01),               # just above that tie
]


@pytest.mark.parametrize("bamax,scale,bits", SUBNORMAL_CASES)
def test_subnormal_block_scales_te(bamax, scale, bits):
    x = torch.tensor([[bamax] + [bamax / 3] + [0.0] * 14])
    t = quantize(x, "te", scaling="static", amax=2688.0)
    assert t.scales.float().item() == scale and t.scales.view(torch.uint8).item() == bits
    if scale == 0:  # enc = min(1/0, FLT_MAX): x * FLT_MAX clips to 6, TE's behaviour; decodes to 0
        assert codes_of(t)[0][:2] == [7, 7] and dequantize(t).abs().sum() == 0


def test_subnormal_scales_modelopt_floor_and_vllm_zero_guard():
    x = torch.tensor([[0.001, -0.0005] + [0.0] * 14])
    mo = quantize(x, "modelopt", scaling="static", amax=2688.0)  # b = 0.001/6 -> clamp to 2**-9
    assert mo.scales.float().item() == 2.0 ** -9 and codes_of(mo)[0][:2] == [1, 9]  # 0.512 -> .5, -0.256 -> -.5
    vl = quantize(x, "vllm", scaling="static", global_encode_scale=1.0)  # scale 0: enc = recip(0) = 1e-8
    assert vl.scales.float().item() == 0.0 and codes_of(vl)[0][:2] == [0, 8]


# ------------------------------------------------------------------------------------ tiles and scaling
def test_16x16_tiles_share_scale_over_rows():
    x = torch.full((16, 32), 0.5)
    x[5, 3] = 6.0     # tile 0 amax
    x[12, 20] = -3.0  # tile 1 amax
    t = quantize(x, "te", tile=(16, 16))
    # S_enc = 448, fl(448 * fl(1/6)) = 74.66667175; 6 * that = 448.00003 -> 448; 3 * that = 224.00002 -> 224
    assert t.scales.float().tolist() == [[448.0, 224.0]] * 16
    c = torch.tensor(codes_of(t))
    assert c[5, 3] == 7 and c[12, 20] == 15
    assert (c[:, :16].flatten().tolist().count(1) == 255)      # 0.5 * 448/448 -> 0.5
    assert (c[:, 16:].flatten().tolist().count(2) == 255)      # 0.5 * 448/224 = 1.0
    one_d = quantize(x, "te")  # 1x16: row 0 block 0 has amax 0.5 -> its own scale 37.33 -> 36
    assert one_d.scales.float()[0, 0] == 36.0
    assert codes_of(one_d)[0][0] == 7  # 0.5 * 448/36 = 6.2: the 1x16 and 16x16 codes differ too


@pytest.mark.parametrize("formula", FORMULAS)
def test_row_scaling_equals_per_row_tensor_scaling(formula):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    t = quantize(x, formula, scaling="row")
    assert t.global_scale.shape == (5,)
    for i in range(5):
        r = quantize(x[i:i + 1], formula)
        assert torch.equal(t.codes[i], r.codes[0]) and torch.equal(t.scales[i].view(torch.uint8),
                                                                     r.scales[0].view(torch.uint8))
        assert t.global_scale[i] == r.global_scale


@pytest.mark.parametrize("formula", FORMULAS)
def test_static_with_own_amax_equals_dynamic(formula):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    kw = dict(global_encode_scale=1 / (x.abs().amax() / 2688)) if formula == "vllm" else dict(amax=x.abs().amax())
    a, b = quantize(x, formula), quantize(x, formula, scaling="static", **kw)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))


@pytest.mark.parametrize("formula", FORMULAS)
def test_static_scaling_clips(formula):
    x = torch.tensor([[10.0, -10.0, 4.0, 1.0] + [0.0] * 12, [1.0] * 16])
    kw = dict(global_encode_scale=2688 / 4.0) if formula == "vllm" else dict(amax=4.0)
    t = quantize(x, formula, scaling="static", **kw)
    assert t.scales.float()[0, 0] == 448.0  # 10 * 2688/4/6 = 1120 -> 448
    assert codes_of(t)[0][:4] == [7, 15, 7, 3]  # +-10 clip to +-6, 4 * 6/4 = 6; 1 * 448/(448*4/6) = 1.5
    assert dequantize(t)[0, 0].item() == pytest.approx(4.0, rel=1e-6)


def test_noncontiguous_and_bf16_input():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    for f in FORMULAS:
        assert torch.equal(quantize(x.t(), f).codes, quantize(x.t().contiguous(), f).codes)
        xb = x.bfloat16()
        assert torch.equal(quantize(xb, f).codes, quantize(xb.float(), f).codes)


# ------------------------------------------------------------------------------------------------ RHT
def _sylvester16():
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return h


def test_rht_matrix_is_te_signs_times_sylvester():
    te_signs = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE get_wgrad_sign_vector()
    h = _sylvester16()
    assert (h @ h.T == 16 * np.eye(16)).all()
    m = rht_matrix().numpy()
    assert (m == np.diag(te_signs) @ h / 4).all()
    assert (m @ m.T == np.eye(16)).all()  # exact: entries +-1/4, sums of 16 products of 1/16


def test_rht16_matches_spec_and_inverts():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=g)
    want = (x.double().numpy().reshape(-1, 16) @ (np.diag(nvfp4.RHT_SIGNS) @ _sylvester16() / 4))
    assert torch.equal(rht16(x), torch.from_numpy(want.astype(np.float32)).reshape(6, 64))
    back = rht16(rht16(x), inverse=True)
    assert torch.allclose(back, x, rtol=0, atol=4 * 2.0 ** -23 * x.abs().max().item())
    xd = torch.randint(-64, 65, (6, 64), generator=g).float() / 8  # dyadic: every step exact
    assert torch.equal(rht16(rht16(xd), inverse=True), xd)
    assert torch.allclose(rht16(x).view(-1, 16).norm(dim=1), x.view(-1, 16).norm(dim=1), rtol=1e-6)


@pytest.mark.parametrize("formula", FORMULAS)
def test_quantize_rht_is_quantize_of_rht(formula):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 3
    a, b = quantize(x, formula, rht=True), quantize(rht16(x), formula)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)  # amax taken after the transform, as TE does


# --------------------------------------------------------------------------------- stochastic rounding
def _hash32(v):  # the documented mixer, on Python ints
    m = 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & m
    v ^= v >> 15
    v = (v * 0x297A2D39) & m
    return v ^ (v >> 16)


def test_stochastic_uniform_stream_is_the_documented_hash():
    u = stochastic_uniform(12345, 3, 5, "cpu")
    want = [[(_hash32(_hash32(i * 5 + j) ^ 12345) >> 8) / 2 ** 24 for j in range(5)] for i in range(3)]
    assert u.tolist() == want
    big = stochastic_uniform(7, 256, 256, "cpu")
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean().item() - 0.5) < 0.005
    hist = torch.histc(big, bins=16, min=0, max=1)
    assert (hist - 4096).abs().max() < 5 * 64  # 5 sigma of a binomial(65536, 1/16)


SR_ROW = [6.0, 0.3, -0.3, 0.7, 1.1, 1.6, 2.2, 2.9, 3.3, 4.4, 5.5, -5.5, 0.1, -1.9, 1.5, 5.9]


@pytest.mark.parametrize("formula", FORMULAS)
def test_sr_unbiased_and_only_neighbours(formula):
    n = 4096
    x = torch.tensor([SR_ROW] * n)
    t = quantize(x, formula, rounding="stochastic", generator=torch.Generator().manual_seed(0),
                 **IDENTITY[formula])
    d = dequantize(t)  # identity setup: the value rounded is x itself
    grid = sorted({abs(v) for v in E2M1_VALUES})
    for j, v in enumerate(SR_ROW):
        a = abs(v)
        lo = max(gv for gv in grid if gv <= a)
        hi = min(gv for gv in grid if gv >= a)
        got = set(d[:, j].abs().tolist())
        assert got <= {lo, hi}, (v, got)
        p = (a - lo) / (hi - lo) if hi > lo else 0.0
        sd = (hi - lo) * (p * (1 - p) / n) ** 0.5
        assert abs(d[:, j].mean().item() - float(np.float32(v))) <= 5 * sd + 1e-6, (v, d[:, j].mean())


def test_sr_follows_documented_stream():
    x = torch.tensor([SR_ROW] * 64)
    g = torch.Generator().manual_seed(42)
    g_copy = torch.Generator()
    g_copy.set_state(g.get_state())
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g_copy).item())  # the documented seed draw
    t = quantize(x, "te", rounding="stochastic", generator=g, **IDENTITY["te"])
    u = stochastic_uniform(seed, 64, 16, "cpu")
    a = x.abs()
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 1e9])
    lo_i = torch.searchsorted(grid, a, right=True) - 1
    lo, hi = grid[lo_i], grid[lo_i + 1]
    up = (u < (a - lo) / (hi - lo)) & (a < 6)
    assert torch.equal(unpack_codes(t.codes).long() & 7, lo_i + up.long())


def test_sr_strict_less_than():
    """Up iff u < frac: set every value so that frac == u exactly (a = u/2 in [0, 0.5), identity setup);
    none may round up. A `<=` slip would round every one of them up."""
    g = torch.Generator().manual_seed(3)
    g_copy = torch.Generator()
    g_copy.set_state(g.get_state())
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g_copy).item())
    x = stochastic_uniform(seed, 32, 64, "cpu") / 2  # exact: u has 24 fraction bits
    x[:, 0::16] = 6.0
    t = quantize(x, "te", rounding="stochastic", generator=g, **IDENTITY["te"])
    c = unpack_codes(t.codes)
    c[:, 0::16] = 0
    assert c.sum() == 0


def test_sr_deterministic_per_generator():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(9))

    def q(g):
        return quantize(x, "te", rounding="stochastic", generator=g).codes

    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    first = q(g1)
    assert torch.equal(first, q(g2))
    assert not torch.equal(first, q(g1))  # the generator advanced
    assert not torch.equal(first, q(torch.Generator().manual_seed(2)))
    torch.manual_seed(5)
    d1 = quantize(x, "te", rounding="stochastic").codes
    torch.manual_seed(5)
    assert torch.equal(d1, quantize(x, "te", rounding="stochastic").codes)


# ------------------------------------------------------------------------------------------- properties
def _halfgap(q):
    q = abs(q)
    return 0.25 if q < 2 else (0.5 if q < 4 else 1.0)


@st.composite
def matrices(draw):
    m, nb = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    vals = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=m * nb * 16, max_size=m * nb * 16))
    x = np.array(vals, dtype=np.float32).reshape(m, nb * 16) * np.float32(2.0 ** draw(st.integers(-30, 30)))
    if draw(st.booleans()):
        x[:, :16] = 0  # a zero block
    return x


@HYP
@given(matrices(), st.sampled_from(FORMULAS), st.sampled_from(["tensor", "row"]))
def test_roundtrip_error_bound(x, formula, scaling):
    """|x - dq| <= (half the grid gap at the chosen point + any clip excess) * s * S_dec, per element."""
    if np.abs(x).max() < 1e-30:  # S_dec itself subnormal: no relative precision left to bound
        x[0, 0] = 1.0
    t = quantize(torch.from_numpy(x), formula, scaling=scaling)
    c = unpack_codes(t.codes).numpy()
    assert c.max() <= 15 and not ((c >= 8) & (x >= 0)).any()  # a sign nibble only on negative inputs
    dq = dequantize(t).double().numpy()
    q = np.array(E2M1_VALUES)[c]
    s = np.repeat(t.scales.float().double().numpy(), 16, axis=1)
    sd = t.row_global_scale().double().numpy()[:, None]
    d = s * sd
    xd = x.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(d > 0, np.maximum(np.abs(xd) / d - 6, 0), 0)
        halfgap = np.vectorize(_halfgap)(q)
        bound = np.where(d > 0, (halfgap + excess) * d * (1 + 1e-5), 6 * 2.0 ** -10 * sd * (1 + 1e-5))
    assert (np.abs(dq - xd) <= bound + np.abs(xd) * 1e-6 + 1e-40).all()
    normal = s >= 2.0 ** -6  # a normal E4M3 scale is off by at most half its ulp: clipping is at most 1/16
    assert (excess[normal] <= 6 / 16 * (1 + 1e-5) + 1e-6).all()


@HYP
@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 2 ** 31))
def test_pack_unpack_roundtrip(m, kb, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 16, (m, 2 * kb), generator=g, dtype=torch.uint8)
    p = pack_codes(c)
    assert p.dtype == torch.uint8 and p.shape == (m, kb)
    assert torch.equal(unpack_codes(p), c) and torch.equal(pack_codes(unpack_codes(p)), p)
    assert torch.equal(p, c[:, 0::2] + 16 * c[:, 1::2])  # element 2j low nibble, 2j+1 high


def test_packing_layout_literal():
    t = quantize(torch.tensor([[6.0, 0.5, -1.0, 0.0] + [0.0] * 12]), "te", **IDENTITY["te"])
    assert t.codes[0, :2].tolist() == [0x17, 0x0A]  # (7 | 1 << 4), (10 | 0 << 4)


# -------------------------------------------------------------------------------------------- bad input
BAD = [
    (torch.zeros(2, 24), {}, "K % 16"),
    (torch.zeros(32), {}, "2D"),
    (torch.zeros(2, 2, 16), {}, "2D"),
    (torch.zeros(2, 16, dtype=torch.int32), {}, "floating"),
    (torch.tensor([[float("nan")] + [0.0] * 15]), {}, "NaN or Inf"),
    (torch.tensor([[float("inf")] + [0.0] * 15]), {}, "NaN or Inf"),
    (torch.tensor([[-float("inf")] + [0.0] * 15]), {}, "NaN or Inf"),
    (torch.full((1, 16), 3e38), dict(rht=True), "NaN or Inf"),
    (torch.tensor([[float("nan")] + [0.0] * 15]), dict(scaling="static", amax=1.0), "NaN or Inf"),
    (torch.tensor([[float("inf")] + [0.0] * 15]), dict(formula="vllm", scaling="static", global_encode_scale=1.0),
     "NaN or Inf"),
    (torch.zeros(2, 16), dict(formula="fp4"), "unknown formula"),
    (torch.zeros(2, 16), dict(scaling="block"), "unknown scaling"),
    (torch.zeros(2, 16), dict(rounding="up"), "unknown rounding"),
    (torch.zeros(2, 16), dict(tile=(1, 32)), "tile"),
    (torch.zeros(2, 16), dict(tile=16), "tile"),
    (torch.zeros(2, 16), dict(tile=(16, 16)), "M % 16"),
    (torch.zeros(16, 16), dict(tile=(16, 16), rht=True), "RHT"),
    (torch.zeros(16, 16), dict(tile=(16, 16), scaling="row"), "row scaling"),
    (torch.zeros(2, 16), dict(scaling="static"), "needs amax"),
    (torch.zeros(2, 16), dict(formula="modelopt", scaling="static"), "needs amax"),
    (torch.zeros(2, 16), dict(formula="vllm", scaling="static"), "exactly one"),
    (torch.zeros(2, 16), dict(formula="vllm", scaling="static", amax=1.0, global_encode_scale=1.0), "exactly one"),
    (torch.zeros(2, 16), dict(amax=1.0), "static"),
    (torch.zeros(2, 16), dict(scaling="static", amax=1.0, global_encode_scale=1.0), "vLLM"),
    (torch.zeros(2, 16), dict(scaling="static", amax=-1.0), "amax"),
    (torch.zeros(2, 16), dict(scaling="static", amax=float("nan")), "amax"),
    (torch.zeros(2, 16), dict(scaling="static", amax=[1.0, 2.0]), "amax"),
    (torch.zeros(2, 16), dict(formula="vllm", scaling="static", global_encode_scale=0.0), "global_encode_scale"),
]


@pytest.mark.parametrize("x,kw,msg", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_raises(x, kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        quantize(x, **kw)


def test_check_false_skips_the_scan(monkeypatch):
    x = torch.tensor([[float("nan")] + [1.0] * 15])
    with pytest.raises(ValueError):
        quantize(x, "te")                                   # the scan finds the NaN
    scans = []
    monkeypatch.setattr(nvfp4, "check_finite", lambda *a, **k: scans.append(a))
    assert quantize(x, "te").codes.shape == (1, 8) and scans  # the scan runs by default ...
    scans.clear()
    t = quantize(x, "te", check=False)                      # ... and not at all when the caller promised
    assert scans == [] and isinstance(t, NVFP4Tensor) and t.codes.shape == (1, 8)


# -------------------------------------------------------------------------------- dequantize, GEMM oracle
def _examples():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-2, 2, 8)[:, None]
    # block amaxes over 5 decades within each row: the K-sum needs more than fp32's 24 bits to be exact
    x[:, 32:] = torch.randn(8, 32, generator=g) * torch.logspace(-5, 0, 32)
    return [quantize(x, f, scaling=s) for f in FORMULAS for s in ("tensor", "row")]


def test_dequantize_is_e2m1_times_scale_times_sdec_rounded_once():
    for t in _examples():
        c = unpack_codes(t.codes).numpy()
        s = np.repeat(t.scales.float().double().numpy(), 16, axis=1)
        sd = t.row_global_scale().double().numpy()[:, None]
        want = (np.array(E2M1_VALUES)[c] * s * sd).astype(np.float32)  # exact in fp64, one rounding
        assert np.array_equal(dequantize(t).numpy(), want)


def test_matmul_reference_against_exact_loop():
    ts = _examples()
    for a, b in [(ts[0], ts[1]), (ts[3], ts[4]), (ts[5], ts[2])]:
        out = nvfp4_matmul_reference(a, b)
        ua = [[Fraction(E2M1_VALUES[c]) for c in r] for r in unpack_codes(a.codes).tolist()]
        ub = [[Fraction(E2M1_VALUES[c]) for c in r] for r in unpack_codes(b.codes).tolist()]
        sa, sb = a.scales.float().tolist(), b.scales.float().tolist()
        ga, gb = a.row_global_scale().tolist(), b.row_global_scale().tolist()
        for i in range(a.shape[0]):
            for j in range(b.shape[0]):
                acc = Fraction(0)
                for blk in range(a.shape[1] // 16):  # block by block: sa * sb * <16-vector dot>
                    dot = sum(ua[i][k] * ub[j][k] for k in range(blk * 16, blk * 16 + 16))
                    acc += Fraction(sa[i][blk]) * Fraction(sb[j][blk]) * dot
                assert Fraction(float(acc)) == acc  # the K-sum is exact in fp64, so summation order is moot
                want = np.float32(float(acc) * ga[i] * gb[j])  # then (acc * ga) * gb in fp64, one fp32 rounding
                assert out[i, j].item() == want, (i, j)
        da, db = dequantize(a).double(), dequantize(b).double()  # each element already rounded to fp32
        assert ((out.double() - da @ db.T).abs() <= 1e-6 * (da.abs() @ db.abs().T) + 1e-38).all()
    with pytest.raises(ValueError, match="K mismatch"):
        nvfp4_matmul_reference(ts[0], quantize(torch.ones(2, 32)))


def test_nvfp4tensor_accessors():
    t = quantize(torch.ones(3, 32), "te")
    assert t.shape == (3, 32) and t.device.type == "cpu" and t.row_global_scale().shape == (3,)
    assert t.codes.dtype == torch.uint8 and t.scales.dtype == torch.float8_e4m3fn
    assert t.global_scale.dtype == torch.float32 and t.global_scale.dim() == 0
    u = t.to("cpu")
    assert torch.equal(u.codes, t.codes)


def test_rows_slices_codes_scales_and_a_per_row_global_scale():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g) * torch.logspace(-2, 2, 6)[:, None]
    for scaling in ("tensor", "row"):
        t = quantize(x, "te", scaling=scaling)
        part = t.rows(2, 5)
        assert part.shape == (3, 32)
        assert torch.equal(part.codes, t.codes[2:5]) and torch.equal(part.scales.view(torch.uint8),
                                                                      t.scales[2:5].view(torch.uint8))
        assert torch.equal(part.row_global_scale(), t.row_global_scale()[2:5])
        assert part.global_scale.dim() == t.global_scale.dim()  # a per-tensor scale stays one scalar
        assert torch.equal(dequantize(part), dequantize(t)[2:5])
