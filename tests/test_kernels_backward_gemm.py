"""The backward pass's NVFP4 pieces: W^T from 16x16 tiles (exact), the grouped GEMM with per-K-segment weight
scales (fused gate/up shards), and the token-grouped wgrad GEMM — each against the float64 reference, the
Triton kernel (interpreter here, the GPU under the gpu marker) against the exact PyTorch path."""
import pytest
import torch
from minite.kernels import (
    NVFP4Experts,
    checks,
    grouped_nvfp4_gemm,
    nvfp4_gemm,
    transpose_experts,
    transpose_weight,
    wgrad_grouped_nvfp4_gemm,
)
from minite.kernels.backward_gemm import WGRAD_CONFIG, transpose_tiled

from minite import nvfp4 as ref


def _q(m, k, seed, scale=1.0, **kw):
    g = torch.Generator().manual_seed(seed)
    return ref.quantize(torch.randn(m, k, generator=g) * scale, **kw)


def _cols(t: ref.NVFP4Tensor, lo: int, hi: int) -> ref.NVFP4Tensor:
    return ref.NVFP4Tensor(t.codes[:, lo // 2:hi // 2].contiguous(), t.scales[:, lo // 16:hi // 16].contiguous(),
                           t.global_scale)


def test_transpose_of_16x16_tiles_is_exact():
    w = _q(48, 80, 0, tile=(16, 16))
    wt = transpose_weight(w)
    assert wt.shape == (80, 48)
    assert torch.equal(ref.dequantize(wt), ref.dequantize(w).T)
    # a 1x16-block tensor whose scales differ inside a tile is not a tiled weight: the result would be wrong,
    # which is why the trainer only transposes (16, 16) weights
    assert not torch.equal(ref.dequantize(transpose_weight(_q(32, 32, 1))), ref.dequantize(_q(32, 32, 1)).T)
    with pytest.raises(ValueError, match="N % 16"):
        transpose_tiled(torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 2).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="per-row global"):
        transpose_weight(_q(32, 32, 2, scaling="row"))


def test_transpose_experts_turns_shards_into_k_segments():
    pieces = [[_q(32, 64, 10 * e + s, scale=1 + 3 * s, tile=(16, 16)) for s in range(2)] for e in range(3)]
    ex = NVFP4Experts(torch.stack([torch.cat([p.codes for p in ps]) for ps in pieces]),
                      torch.stack([torch.cat([p.scales for p in ps]) for ps in pieces]),
                      torch.stack([torch.cat([p.row_global_scale() for p in ps]) for ps in pieces]))
    wt = transpose_experts(ex, shards=2)
    assert wt.shape == (3, 64, 64) and wt.global_scale.shape == (3, 2)
    for e in range(3):
        for s in range(2):
            assert wt.global_scale[e, s] == pieces[e][s].global_scale
            units = ref.NVFP4Tensor(wt.codes[e], wt.scales[e], torch.tensor(1.0))
            want = ref.dequantize(ref.NVFP4Tensor(pieces[e][s].codes, pieces[e][s].scales, torch.tensor(1.0))).T
            assert torch.equal(ref.dequantize(units)[:, 32 * s:32 * (s + 1)], want)
    with pytest.raises(ValueError, match="per-row global"):
        transpose_experts(ex)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_grouped_gemm_with_k_segment_scales(backend):
    """dgrad through fused shards: dy [S, 2I] against W^T [E, K, 2I] whose two I-wide K segments carry their
    own global scales == the sum of the two segment GEMMs' exact values."""
    e, k, seg = 3, 48, 128
    pieces = [[_q(seg, k, 100 + 2 * i + s, scale=1 + 5 * s, tile=(16, 16)) for s in range(2)] for i in range(e)]
    ex = NVFP4Experts(torch.stack([torch.cat([p.codes for p in ps]) for ps in pieces]),
                      torch.stack([torch.cat([p.scales for p in ps]) for ps in pieces]),
                      torch.stack([torch.cat([p.row_global_scale() for p in ps]) for ps in pieces]))
    wt = transpose_experts(ex, shards=2)
    a = _q(21, 2 * seg, 7, scaling="row")
    offs = torch.tensor([0, 6, 6, 21])
    out = grouped_nvfp4_gemm(a, wt, offs, torch.float32, backend=backend, k_segments=2)
    for i, (lo, hi) in enumerate(((0, 6), (6, 6), (6, 21))):
        if hi == lo:
            continue
        rows = a.rows(lo, hi)
        want = sum(ref.nvfp4_matmul_reference(_cols(rows, s * seg, (s + 1) * seg),
                                              transpose_weight(pieces[i][s])).double() for s in range(2))
        tol = 1e-6 if backend == "torch" else 1e-5  # the reference rounds each segment to fp32
        assert checks.rel_err(out[lo:hi], want) < tol
    with pytest.raises(ValueError, match="k_segments"):
        grouped_nvfp4_gemm(a, wt, offs, torch.float32, backend=backend, k_segments=3)
    if backend == "triton":  # a config whose kernel has no segment loop refuses, rather than ignore the scales
        for cfg in (dict(variant="cuda", NT=1, W=4, D=8), dict(variant="w16", BM=64, BN=64, num_warps=4)):
            with pytest.raises(ValueError, match="does not take K segments"):
                grouped_nvfp4_gemm(a, wt, offs, torch.float32, backend=backend, k_segments=2, config=cfg)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_wgrad_grouped_reduces_each_segment(backend):
    m, n, t = 40, 24, 768
    a, b = _q(m, t, 1), _q(n, t, 2, scale=3.0, scaling="row")
    # segments of whole 16-blocks, not of whole 128-wide K steps: a one-block segment, an empty one, one
    # starting mid-step and spanning 3 steps (the last one partial), one of exactly one step; past 640: unread
    ends = torch.tensor([16, 16, 512, 640])
    out = wgrad_grouped_nvfp4_gemm(a, b, ends, torch.float32, backend=backend)
    assert out.shape == (4, m, n)
    assert torch.equal(out[1], torch.zeros(m, n))
    for e, (lo, hi) in enumerate(((0, 16), (16, 16), (16, 512), (512, 640))):
        if hi == lo:
            continue
        want = ref.nvfp4_matmul_reference(_cols(a, lo, hi), _cols(b, lo, hi))
        if backend == "torch":
            assert torch.equal(out[e], want)
        else:  # the same fp32 chain as the dense kernel over those columns
            assert checks.rel_err(out[e], want) < 1e-5
            assert torch.equal(out[e], nvfp4_gemm(_cols(a, lo, hi), _cols(b, lo, hi), torch.float32,
                                                  backend="triton", config=dict(BM=32, BN=32, GROUP_M=4,
                                                                                num_warps=4, num_stages=1,
                                                                                variant="f16")))
    bf = wgrad_grouped_nvfp4_gemm(a, b, ends, backend=backend)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out.bfloat16())


def test_segment_decode_lays_each_segment_out_as_the_dense_decode_of_it_alone():
    """decode_f16_segments: segment e (whole 16-blocks, anywhere) -> its own run of 128-wide K steps, equal
    to decode_f16 of its columns alone; the step-aligned ends."""
    from minite.kernels.backward_gemm import decode_f16_segments
    from minite.kernels.weights import decode_f16
    t = _q(5, 800, 3, scaling="row")
    ends = torch.tensor([16, 16, 304, 432, 800], dtype=torch.int32)
    f16, step_ends = decode_f16_segments(t, ends)
    assert step_ends.tolist() == [128, 128, 512, 640, 1024]
    assert f16.shape == (5, (800 + 112 * 5 + 127) // 128 * 128)
    lo, plo = 0, 0
    for hi, phi in zip(ends.tolist(), step_ends.tolist(), strict=True):
        if hi > lo:
            assert torch.equal(f16[:, plo:phi], decode_f16(_cols(t, lo, hi)))
        lo, plo = hi, phi
    assert decode_f16_segments(t, ends, write_ends=False)[1] is None


def test_wgrad_grouped_bad_inputs():
    a, b = _q(8, 256, 1), _q(8, 256, 2)
    for ends, msg in (([100, 256], "multiples of 16"), ([256, 128], "non-decreasing"), ([128, 384], "up to T")):
        with pytest.raises(ValueError, match=msg):
            wgrad_grouped_nvfp4_gemm(a, b, torch.tensor(ends))
    with pytest.raises(ValueError, match="same tokens"):
        wgrad_grouped_nvfp4_gemm(a, _q(8, 128, 3), torch.tensor([128]))
    with pytest.raises(ValueError, match="int32/int64"):
        wgrad_grouped_nvfp4_gemm(a, b, torch.tensor([128.0]))


@pytest.mark.gpu
def test_gpu_backward_gemms():
    """On the GPU: the token-grouped wgrad kernel is the dense kernel's chain over each segment (bitwise, same
    tile config) and the exact path's value to fp32 accumulation; the K-segment grouped GEMM likewise."""
    dev = torch.device("cuda")
    m, n, t = 300, 520, 4096
    a, b = _q(m, t, 1).to(dev), _q(n, t, 2, scale=3.0).to(dev)
    ends = torch.tensor([496, 496, 2032, 3968], device=dev)   # 16-block bounds inside 128-wide K steps
    out = wgrad_grouped_nvfp4_gemm(a, b, ends, torch.float32)
    exact = wgrad_grouped_nvfp4_gemm(a, b, ends, torch.float32, backend="torch")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for e, (lo, hi) in enumerate(((0, 496), (496, 2032), (2032, 3968))):
        e = (0, 2, 3)[e]
        assert checks.rel_err(out[e], exact[e]) < 1e-5
        dense = nvfp4_gemm(_cols(a, lo, hi), _cols(b, lo, hi), torch.float32, config=dict(WGRAD_CONFIG, variant="f16"))
        assert torch.equal(out[e], dense)
    e_, k, seg = 4, 256, 384
    tiles = (torch.rand(e_, 2 * seg // 16, k // 16) * 4 + 0.5).to(torch.float8_e4m3fn)   # one scale per 16x16
    ex = NVFP4Experts(torch.randint(0, 256, (e_, 2 * seg, k // 2), dtype=torch.uint8),
                      tiles.view(torch.uint8).repeat_interleave(16, dim=1).view(torch.float8_e4m3fn),
                      (torch.rand(e_, 2) + 0.5).repeat_interleave(seg, dim=1))
    wt = transpose_experts(ex, shards=2)
    x = _q(1000, 2 * seg, 5, scaling="row")
    offs = torch.tensor([0, 100, 100, 700, 1000])
    got = grouped_nvfp4_gemm(x.to(dev), wt.to(dev), offs.to(dev), torch.float32, k_segments=2)
    want = grouped_nvfp4_gemm(x, wt, offs, torch.float32, backend="torch", k_segments=2)
    assert checks.rel_err(got.cpu(), want) < 1e-5
