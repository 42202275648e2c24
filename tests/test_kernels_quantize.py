"""minite.kernels.quantize: bit-identical to minite.nvfp4.quantize (Triton interpreter on CPU)."""
import itertools

import pytest
import torch

from minite import nvfp4 as ref
from minite.kernels import quantize
from minite.kernels.checks import check_quantize, spread_input


def _same(q, r):
    assert torch.equal(q.codes, r.codes)
    assert torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))
    assert q.global_scale.shape == r.global_scale.shape and q.global_scale.dtype == torch.float32
    assert torch.equal(q.global_scale, r.global_scale)


@pytest.mark.parametrize("scaling,rounding,rht", list(itertools.product(
    ("tensor", "row", "static"), ("nearest", "stochastic"), (False, True))))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_bit_exact_all_modes(scaling, rounding, rht, dtype):
    x = spread_input(9, 400, "cpu", dtype, seed=3)  # K=400: not a power of two (padded row)
    kw = dict(scaling=scaling, rounding=rounding, rht=rht, amax=2.0 if scaling == "static" else None)
    q = quantize(x, generator=torch.Generator().manual_seed(11), backend="triton", **kw)
    r = ref.quantize(x, generator=torch.Generator().manual_seed(11), **kw)
    _same(q, r)


def test_static_clipping_zero_tensor_and_extremes():
    x = torch.randn(4, 64) * 100  # beyond the static amax: clips like the reference
    _same(quantize(x, scaling="static", amax=1.0, backend="triton"), ref.quantize(x, scaling="static", amax=1.0))
    z = torch.zeros(3, 32)
    _same(quantize(z, backend="triton"), ref.quantize(z))
    _same(quantize(z, scaling="row", backend="triton"), ref.quantize(z, scaling="row"))
    e = torch.tensor([[3e38, -1e-38] + [1e-45] * 14, [-0.0] * 8 + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0]])
    for scaling in ("tensor", "row"):
        _same(quantize(e, scaling=scaling, backend="triton"), ref.quantize(e, scaling=scaling))


def test_default_generator_stream_matches():
    x = torch.randn(3, 48)
    torch.manual_seed(5)
    q = quantize(x, rounding="stochastic", backend="triton")
    torch.manual_seed(5)
    _same(q, ref.quantize(x, rounding="stochastic"))


def test_fallbacks_and_errors():
    x = torch.randn(32, 64)
    for kw in (dict(formula="vllm"), dict(formula="modelopt"), dict(tile=(16, 16))):
        _same(quantize(x, backend="triton", **kw), ref.quantize(x, **kw))
    _same(quantize(x), ref.quantize(x))  # CPU default: the torch reference
    with pytest.raises(ValueError, match="K % 16"):
        quantize(torch.randn(2, 40), backend="triton")
    bad = torch.randn(4, 32)
    bad[1, 3] = float("nan")
    for scaling in ("tensor", "row"):
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize(bad, scaling=scaling, backend="triton")
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(bad, scaling="static", amax=1.0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        quantize(x, backend="cuda-magic")


@pytest.mark.gpu
def test_gpu_quantize_bit_exact():
    res = check_quantize(torch.device("cuda"))
    assert all(ok for _, ok, _ in res), [r for r in res if not r[1]]
