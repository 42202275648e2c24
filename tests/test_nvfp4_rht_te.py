"""minite.nvfp4's RHT quantization against Transformer Engine's NVFP4 reference semantics.

TE (``NVFP4QuantizerRef``: ``_apply_rht``, ``_quantize_blockwise_reference``) transforms the wgrad operand
in the input's dtype — ``x.view(-1, 16) @ (diag(sign) @ H16 * 0.25)`` as a BF16 matmul for BF16 inputs — and
takes the global and block amax from those BF16 values. Hand-worked blocks pin both rules; a randomized test
compares against an independent re-implementation of TE's semantics written here (float64 where TE's fp32
sum is exact, numpy fp32 for the scale arithmetic, TE's threshold table for E2M1), and against TE's own
op, torch's BF16 matmul.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minite import nvfp4
from minite.nvfp4 import dequantize, quantize, rht16, unpack_codes

TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)   # TE get_wgrad_sign_vector()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _codes(t) -> list[int]:
    return unpack_codes(t.codes).flatten().tolist()


# ------------------------------------------------------------------------------------- hand-worked blocks
def test_transform_in_bf16_moves_a_value_onto_an_e2m1_tie():
    """x = [16, 1.96875, 6.03125, 0...] (all BF16). Rows 0-2 of diag(s) H16 / 4 have signs +1 and the
    patterns (+), (+-), (++--) along j, so y_j = (16 +- 1.96875 +- 6.03125) / 4:
        j % 4 == 0: 24/4      = 6                  BF16 exact
        j % 4 == 1: 20.0625/4 = 5.015625 = 5+2**-6  BF16 spacing on [4, 8) is 2**-5: a tie, to even -> 5.0
        j % 4 == 2: 11.9375/4 = 2.984375            BF16 exact
        j % 4 == 3: 8/4       = 2                   BF16 exact
    Static amax 2688 gives S_enc = 1; block amax 6 gives scale e4m3(6 * fl(1/6)) = 1, so the codes are
    RNE_e2m1(y): 6 -> 7, 5.0 -> the tie between 4 and 6 goes to the even code 6, 2.984 -> 5 (3.0), 2 -> 4.
    Transformed in fp32 (the old rule), 5.015625 is above the tie and gives code 7."""
    x = torch.tensor([[16.0, 1.96875, 6.03125] + [0.0] * 13], dtype=torch.bfloat16)
    assert torch.equal(x.float(), torch.tensor([[16.0, 1.96875, 6.03125] + [0.0] * 13]))  # exact BF16
    y = rht16(x)
    assert y.dtype == torch.bfloat16
    assert y.float().flatten().tolist() == [6.0, 5.0, 2.984375, 2.0] * 4
    q = quantize(x, "te", scaling="static", amax=2688.0, rht=True)
    assert _codes(q) == [7, 6, 5, 4] * 4
    assert q.scales.view(torch.uint8).tolist() == [[0x38]]                # e4m3 1.0
    assert rht16(x.float()).flatten().tolist() == [6.0, 5.015625, 2.984375, 2.0] * 4
    assert _codes(quantize(x.float(), "te", scaling="static", amax=2688.0, rht=True)) == [7, 7, 5, 4] * 4


def test_amax_is_taken_after_the_transform():
    """A one-hot block e_0: amax 1 before the transform, every y_j = s_0 * H[0, j] / 4 = 0.25 after it.
    Tensor scaling then uses amax 0.25: S_enc = 2688 / 0.25 = 10752, S_dec = fl(1 / 10752); block scale
    e4m3(0.25 * fl(10752 * fl(1/6))) = e4m3(448) (0x7E); enc = 1 / (448 * S_dec) ~ 24, so every 0.25 -> 6:
    code 7. With the pre-transform amax (1) S_dec would be 1/2688 and the scale 112."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    assert rht16(x).float().flatten().tolist() == [0.25] * 16
    q = quantize(x, "te", rht=True)
    assert _bits(q.global_scale).item() == _bits(torch.tensor(1.0 / 10752.0, dtype=torch.float32)).item()
    assert q.scales.view(torch.uint8).tolist() == [[0x7E]]                # e4m3 448
    assert _codes(q) == [7] * 16
    assert float(dequantize(q).flatten()[0]) == pytest.approx(0.25, rel=1e-6)


def test_amax_comes_from_the_bf16_rounded_transform():
    """x = [1, 2**-8, 0...]: y_j = (1 +- 2**-8) / 4. 0.25 + 2**-10 is a BF16 tie (spacing 2**-9 on
    [0.25, 0.5)) and rounds to even, 0.25; 0.25 - 2**-10 is BF16-exact (spacing 2**-10 below 0.25). So TE's
    amax is 0.25 exactly (S_dec = 1/10752); in fp32 it would be 0.2509765625."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([1.0, 2.0 ** -8])
    y = rht16(x).float().flatten()
    assert set(y.tolist()) == {0.25, 0.25 - 2.0 ** -10}
    assert float(rht16(x.float()).abs().max()) == 0.25 + 2.0 ** -10
    q = quantize(x, "te", rht=True)
    assert _bits(q.global_scale).item() == _bits(torch.tensor(1.0 / 10752.0)).item()
    q32 = quantize(x.float(), "te", rht=True)
    assert _bits(q32.global_scale).item() != _bits(q.global_scale).item()


def test_fp16_inputs_round_the_transform_to_fp16_and_fp32_stays_fp32():
    x = torch.tensor([[16.0, 1.96875, 6.03125] + [0.0] * 13])
    assert rht16(x.half()).dtype == torch.float16 and rht16(x).dtype == torch.float32
    assert rht16(x.half()).float().flatten().tolist()[:2] == [6.0, 5.015625]   # FP16 holds 5 + 2**-6
    assert rht16(x.double()).dtype == torch.float32                             # other dtypes: fp32


# ---------------------------------------------------------------------- TE's semantics, re-implemented
def _te_hadamard() -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return np.diag(np.array(TE_SIGNS, dtype=np.float64)) @ h * 0.25   # exact in float64


def _te_e2m1(v: np.ndarray) -> np.ndarray:
    """TE's cast_to_fp4x2 table: closed/open interval bounds give ties to the even code; negatives that
    round to zero are code 8, -0.0 itself is code 0."""
    bounds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    a = np.abs(v)
    mag = np.zeros(v.shape, dtype=np.uint8)
    for b, inclusive in bounds:  # an element above bound b (or at it, when the upper code is even) moves up
        mag += (a >= b) if inclusive else (a > b)
    return mag | ((v < 0).astype(np.uint8) << 3)


def te_reference_columnwise(x: torch.Tensor):
    """TE's columnwise NVFP4 output for x [M, N] (BF16): RHT of x^T in BF16, tensor amax of it, 1x16 blocks.
    Returns (codes4 [N, M] uint8, scale bytes [N, M/16], S_dec fp32)."""
    xt = x.t().contiguous().float().numpy().astype(np.float64).reshape(-1, 16)
    y64 = xt @ _te_hadamard()                         # exact: BF16 x (+-1/4) products, sums in 53 bits
    y = torch.from_numpy(y64.astype(np.float32)).bfloat16().float().numpy().reshape(x.shape[1], x.shape[0])
    f32 = np.float32
    amax = np.abs(y).max()
    g_enc = np.minimum(f32(2688.0) / amax, np.finfo(np.float32).max).astype(f32)
    g_enc = f32(1.0) if g_enc == 0 else g_enc
    g_dec = f32(1.0) / g_enc
    mult = g_enc * (f32(1.0) / f32(6.0))
    blocks = y.reshape(y.shape[0], -1, 16)
    s = np.clip(np.minimum(np.abs(blocks).max(-1) * mult, np.finfo(np.float32).max), -448.0, 448.0).astype(f32)
    s_e4m3 = torch.from_numpy(s).to(torch.float8_e4m3fn)
    with np.errstate(divide="ignore"):  # a zero block: 1/0 -> inf -> FLT_MAX, as TE
        enc = np.minimum(f32(1.0) / (s_e4m3.float().numpy() * g_dec), np.finfo(np.float32).max).astype(f32)
    v = np.clip(blocks * enc[..., None], -6.0, 6.0).astype(f32).reshape(y.shape)
    return _te_e2m1(v), s_e4m3.view(torch.uint8).numpy(), g_dec


@pytest.mark.parametrize("seed", range(4))
def test_random_bf16_matches_an_independent_te_reference(seed):
    g = torch.Generator().manual_seed(seed)
    m, n = 96, 48
    x = (torch.randn(m, n, generator=g) * torch.logspace(-4, 4, n)[None, :]).bfloat16()  # columns span 8 decades
    x[:16, 5] = 0                                                                        # a zero block
    codes4, scales, g_dec = te_reference_columnwise(x)
    q = quantize(x.t(), "te", rht=True)                # the wgrad operand: tokens along the block dim
    assert np.array_equal(unpack_codes(q.codes).numpy(), codes4)
    assert np.array_equal(q.scales.view(torch.uint8).numpy(), scales)
    assert _bits(q.global_scale).item() == _bits(torch.tensor(g_dec)).item()


@pytest.mark.parametrize("seed", range(3))
def test_transform_equals_tes_own_bf16_matmul_on_gaussian_data(seed):
    """TE's reference op itself (a BF16 matmul, fp32 accumulation) on Gaussian rows spanning 12 decades:
    bit-equal transformed values and quantization (docstring: where they could differ)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(256, 128, generator=g) * torch.logspace(-6, 6, 256)[:, None]).bfloat16()
    te_matrix = torch.from_numpy(_te_hadamard()).to(torch.bfloat16)     # +-0.25: exact in BF16
    y_te = (x.reshape(-1, 16) @ te_matrix).reshape(x.shape)
    assert torch.equal(_bits(rht16(x)), _bits(y_te))
    for rows in (slice(0, 64), slice(100, 228)):   # tensor amax over a sub-range: same codes either way
        a, b = quantize(x[rows], "te", rht=True), quantize(y_te[rows], "te")
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
        assert torch.equal(_bits(a.global_scale), _bits(b.global_scale))


def test_butterfly_is_the_rht_matrix_and_exact_on_bf16_inputs():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 64, generator=g) * torch.exp(torch.randn(64, 64, generator=g) * 2)).bfloat16()
    want = (x.double().reshape(-1, 16) @ nvfp4.rht_matrix()).reshape(x.shape)  # exact (spans < 41 binades)
    assert torch.equal(_bits(rht16(x)), _bits(want.float().bfloat16()))
    assert torch.equal(rht16(x.float()), want.float())
