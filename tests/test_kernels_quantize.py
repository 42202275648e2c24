"""minite.kernels.quantize: bit-identical to minite.nvfp4.quantize (Triton interpreter on CPU)."""
import itertools

import pytest
import torch
from minite.kernels import quantize
from minite.kernels.checks import check_quantize, same_bits, spread_input

from minite import nvfp4 as ref


def _same(q, r):
    assert torch.equal(q.codes, r.codes)
    assert torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))
    assert q.global_scale.shape == r.global_scale.shape and q.global_scale.dtype == torch.float32
    assert torch.equal(q.global_scale.view(torch.int32), r.global_scale.view(torch.int32))  # bits, not values


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


def _quantize_module():
    import importlib
    return importlib.import_module("minite.kernels.quantize")   # the module (the package exports the function)


@pytest.mark.parametrize("scaling,rounding,rht", [("tensor", "stochastic", True), ("tensor", "nearest", False),
                                                  ("static", "stochastic", False), ("row", "nearest", False)])
def test_wide_rows_in_column_chunks(monkeypatch, scaling, rounding, rht):
    """Rows wider than MAX_KP (MoE wgrad operands) run as CHUNK_KP-wide programs, same bits (SR hash on the
    global index); row scaling there falls back to the reference. Shrunk limits keep the interpreter fast."""
    mod = _quantize_module()
    monkeypatch.setattr(mod, "MAX_KP", 512)
    monkeypatch.setattr(mod, "CHUNK_KP", 256)
    x = spread_input(5, 1040, "cpu", torch.bfloat16, seed=4)    # 5 chunks, the last one partial
    x[2, 700] = 40.0                                            # the tensor amax sits in a later chunk
    kw = dict(scaling=scaling, rounding=rounding, rht=rht, amax=3.0 if scaling == "static" else None)
    q = quantize(x, generator=torch.Generator().manual_seed(2), backend="triton", **kw)
    _same(q, ref.quantize(x, generator=torch.Generator().manual_seed(2), **kw))
    assert mod._layout(1040)[1:] == (256, 4, 5)
    bad = x.clone()
    bad[4, 1030] = float("inf")                                 # caught in the last chunk of the last row
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(bad, scaling="tensor", backend="triton")


def test_widest_real_row_is_chunked():
    mod = _quantize_module()
    k = mod.MAX_KP + 16 * 7                                     # e.g. 32768 routed tokens + expert padding
    assert mod._layout(k)[1] == mod.CHUNK_KP and mod._layout(mod.MAX_KP)[3] == 1
    x = spread_input(2, k, "cpu", torch.float32, seed=8)
    g = torch.Generator().manual_seed(1)
    _same(quantize(x, rounding="stochastic", generator=g, backend="triton"),
          ref.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("scaling", ("tensor", "row"))
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16))
def test_dequantize_bit_exact(scaling, out_dtype):
    from minite.kernels import dequantize
    x = spread_input(37, 272, "cpu", torch.float32, seed=6)
    x[3] = 0.0
    x[5, :16] = torch.tensor([0.0, -0.0, 0.25, -0.75, 1.25, 1.75, 2.5, -3.5, 5.0, -6.0, 1e-30, -1e-30,
                              3.0, 4.0, -4.0, 0.5])
    t = ref.quantize(x, scaling=scaling)
    want = ref.dequantize(t).to(out_dtype)
    got = dequantize(t, out_dtype, backend="triton")
    assert got.dtype == out_dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))  # -0.0 too
    sub = ref.NVFP4Tensor(t.codes, torch.full_like(t.scales, 2 ** -9), t.global_scale)  # subnormal e4m3
    assert same_bits(dequantize(sub, backend="triton"), ref.dequantize(sub))
    assert same_bits(dequantize(t), ref.dequantize(t))                                  # CPU default: reference
    with pytest.raises(ValueError, match="out_dtype"):
        dequantize(t, torch.float16)
