"""minite.kernels.quantize: bit-identical to minite.nvfp4.quantize (Triton interpreter on CPU)."""
import itertools

import pytest
import torch
from minite.kernels import quantize
from minite.kernels.checks import check_quantize, same_bits, spread_input
from minite.kernels.quantize import operand

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


# ----------------------------------------------------------------------------- formula "vllm" (kernel path)
def _vllm_scaling(scaling):
    """scaling name -> quantize kwargs; "static-G" is the sampler's case: vLLM's encode scale G given."""
    return {"tensor": dict(scaling="tensor"), "row": dict(scaling="row"),
            "static": dict(scaling="static", amax=2.0),
            "static-G": dict(scaling="static", global_encode_scale=torch.tensor(2688 / 3.0))}[scaling]


def _same_dq(x, out_dtype, **kw):
    """quantize_dequantize against the reference's dequantize(quantize(x)).to(out_dtype): bits, NaN aside
    (NaN payloads are not defined: torch's own differ by device and by vectorisation)."""
    from minite.kernels import quantize_dequantize
    got = quantize_dequantize(x, out_dtype, generator=torch.Generator().manual_seed(11), **kw)
    kw.pop("backend", None)
    want = ref.dequantize(ref.quantize(x, generator=torch.Generator().manual_seed(11), **kw)).to(out_dtype)
    nan = want.isnan()
    assert got.dtype == out_dtype and torch.equal(got.isnan(), nan)
    assert same_bits(got[~nan], want[~nan])


@pytest.mark.parametrize("scaling,rounding,rht", list(itertools.product(
    ("tensor", "row", "static", "static-G"), ("nearest", "stochastic"), (False, True))))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_vllm_bit_exact_all_modes(scaling, rounding, rht, dtype):
    x = spread_input(9, 400, "cpu", dtype, seed=3)  # K=400: not a multiple of the kernel's column tile
    kw = dict(formula="vllm", rounding=rounding, rht=rht, **_vllm_scaling(scaling))
    q = quantize(x, generator=torch.Generator().manual_seed(11), backend="triton", **kw)
    _same(q, ref.quantize(x, generator=torch.Generator().manual_seed(11), **kw))
    for out_dtype in (torch.float32, torch.bfloat16):
        _same_dq(x, out_dtype, backend="triton", **kw)


@pytest.mark.parametrize("scaling", ("tensor", "static", "static-G"))
def test_vllm_16x16_tiles_and_strided_operands(scaling):
    x = spread_input(32, 96, "cpu", torch.bfloat16, seed=5)
    kw = dict(formula="vllm", **_vllm_scaling(scaling))
    _same(quantize(x, tile=(16, 16), backend="triton", **kw), ref.quantize(x, tile=(16, 16), **kw))
    xt = x[:, :40].t()                                     # a transposed view, zero-padded to 48 columns
    _same(quantize(xt, width=48, backend="triton", **kw), ref.quantize(operand(xt, 48), **kw))


@pytest.mark.parametrize("g", (torch.tensor(2688 / 5.0), 2688 / 5.0, torch.tensor(448.0, dtype=torch.float64)))
@pytest.mark.parametrize("m,k", ((1, 16), (1, 2048), (37, 272)))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_vllm_static_sampler_activations(g, m, k, dtype):
    """The naive arm's sampler activations (minite.engines.gemm.quantize_activation): 1x16, static, G given
    (a 0-dim tensor or a float), check=False; decode (M=1) and prefill shapes; and the emulated GEMM's
    quantize_dequantize."""
    x = spread_input(m, k, "cpu", dtype, seed=m + k) * 3e-6  # inputs up to ~3x the calibrated amax (5): clips
    kw = dict(formula="vllm", scaling="static", global_encode_scale=g)
    _same(quantize(x, check=False, backend="triton", **kw), ref.quantize(x, check=False, **kw))
    for out_dtype in (torch.float32, torch.bfloat16):
        _same_dq(x, out_dtype, check=False, backend="triton", **kw)


# zero blocks, -0.0, ties of the E2M1 grid, values past +-6 and a block past the 448 scale, subnormals
_EDGE = torch.tensor([[0.0] * 16 + [-0.0] * 16 + [3e38, -1e-38] + [1e-45] * 14,
                      [-0.0] * 8 + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0]
                      + [6.0, -6.0, 7.0, -100.0, 1e-3, -1e-3] + [0.0] * 10 + [-2e4] * 16])


@pytest.mark.parametrize("kw", (
    dict(global_encode_scale=1.0), dict(global_encode_scale=2688 / 6.0), dict(global_encode_scale=3.4e38),
    dict(global_encode_scale=1e-46),   # 0 in fp32: G = 0, S_dec = recip(0) = 1e-8 (vLLM's 1e8 guard)
    dict(global_encode_scale=1e-40),   # subnormal: S_dec = inf, 0 * inf = NaN enc -> code 0, NaN values
    dict(amax=0.0), dict(amax=1e-45),  # amax / 2688 = 0: G = recip(0) = 1e8
    dict(amax=2.0), dict(amax=1e38)), ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_vllm_static_edge_cases(kw, dtype):
    x = _EDGE.to(dtype)
    kw = dict(formula="vllm", scaling="static", **kw)
    _same(quantize(x, backend="triton", **kw), ref.quantize(x, **kw))
    for out_dtype in (torch.float32, torch.bfloat16):
        _same_dq(x, out_dtype, backend="triton", **kw)


def test_vllm_dynamic_edge_cases_and_errors():
    for scaling in ("tensor", "row"):
        _same(quantize(_EDGE, formula="vllm", scaling=scaling, backend="triton"),
              ref.quantize(_EDGE, formula="vllm", scaling=scaling))
        z = torch.zeros(3, 32)                               # amax 0: G = 1e8 by the guard
        _same(quantize(z, formula="vllm", scaling=scaling, backend="triton"),
              ref.quantize(z, formula="vllm", scaling=scaling))
    # G = recip(amax / 2688) overflows for a tiny nonzero amax: the reference raises (on G, before it draws);
    # unchecked, G = inf gives NaN block scales for zero blocks, and the kernels give them too
    tiny = torch.tensor([[1e-38] * 16 + [0.0] * 16, [0.0] * 32])
    for kw in (dict(scaling="tensor"), dict(scaling="row"), dict(scaling="static", amax=1e-38),
               dict(scaling="static", global_encode_scale=torch.tensor(1e39, dtype=torch.float64))):
        kw = dict(formula="vllm", rounding="stochastic", **kw)
        g = torch.Generator().manual_seed(3)
        with pytest.raises(ValueError, match="global_encode_scale contains NaN or Inf"):
            quantize(tiny, generator=g, backend="triton", **kw)
        assert torch.equal(g.get_state(), torch.Generator().manual_seed(3).get_state())
        q = quantize(tiny, check=False, generator=torch.Generator().manual_seed(1), backend="triton", **kw)
        r = ref.quantize(tiny, check=False, generator=torch.Generator().manual_seed(1), **kw)
        assert r.scales.float().isnan().any()
        _same(q, r)
    bad = torch.randn(4, 32)
    bad[1, 3] = float("nan")
    for kw in (dict(scaling="tensor"), dict(scaling="row"), dict(scaling="static", global_encode_scale=1.0)):
        with pytest.raises(ValueError, match="input contains NaN or Inf"):
            quantize(bad, formula="vllm", backend="triton", **kw)
    with pytest.raises(ValueError, match="exactly one of amax= or global_encode_scale="):
        quantize(bad, formula="vllm", scaling="static", backend="triton")


def test_vllm_operation_order(device="cpu", backend="triton"):
    """Blocks where another fp32 order gives other bits, at G = 896 (2688 / 3): the scale G * (amax * (1/6))
    is e4m3 code 109 where (G * amax) * (1/6) gives 108; the codes from enc = recip(s * recip(G)) are 1..4 where
    vLLM's CUDA form G / s gives 2..5 (s = 2**-9, a subnormal scale)."""
    x = torch.zeros(2, 16)
    x[0, 0] = 0.6696428656578064
    x[1, :5] = torch.tensor([1.3078962183499243e-05, 1.6348702729374054e-06, 2.724784053498297e-06,
                             3.814697265625e-06, 5.449568106996594e-06])
    x = x.to(device)
    kw = dict(formula="vllm", scaling="static", global_encode_scale=torch.tensor(896.0, device=device))
    r = ref.quantize(x, **kw)
    assert r.scales.view(torch.uint8)[0, 0] == 109
    assert (ref.unpack_codes(r.codes)[1, 1:5].cpu() == torch.arange(1, 5)).all()
    _same(quantize(x, backend=backend, **kw), r)
    _same_dq(x, torch.bfloat16, backend=backend, **kw)


@pytest.mark.gpu
def test_gpu_vllm_bit_exact():
    """Formula "vllm" on the GPU (the default backend there is Triton): every mode, the sampler's static G as
    a CUDA tensor, the edge cases (NaN-propagating clamps and subnormal products matter here, not under the
    interpreter), the operation-order blocks, and quantize_dequantize."""
    dev = torch.device("cuda")
    for (m, k), dtype in itertools.product(((67, 2048), (5, 784), (1, 2048)), (torch.float32, torch.bfloat16)):
        x = spread_input(m, k, dev, dtype, seed=m + k)
        for scaling, rounding, rht in itertools.product(("tensor", "row", "static", "static-G"),
                                                        ("nearest", "stochastic"), (False, True)):
            kw = dict(formula="vllm", rounding=rounding, rht=rht, **_vllm_scaling(scaling))
            if scaling == "static-G":
                kw["global_encode_scale"] = kw["global_encode_scale"].to(dev)
            q = quantize(x, generator=torch.Generator().manual_seed(11), **kw)
            _same(q, ref.quantize(x, generator=torch.Generator().manual_seed(11), **kw))
            for out_dtype in (torch.float32, torch.bfloat16):
                _same_dq(x, out_dtype, **kw)
    for g, dtype in itertools.product((1.0, 2688 / 6.0, 3.4e38, 1e-46, 1e-40), (torch.float32, torch.bfloat16)):
        kw = dict(formula="vllm", scaling="static",  # fp64: 1e-46 is > 0 there, 0 in fp32
                  global_encode_scale=torch.tensor(g, dtype=torch.float64, device=dev))
        x = _EDGE.to(device=dev, dtype=dtype)
        _same(quantize(x, **kw), ref.quantize(x, **kw))
        for out_dtype in (torch.float32, torch.bfloat16):
            _same_dq(x, out_dtype, **kw)
    test_vllm_operation_order(dev, backend=None)
    tiny = torch.tensor([[1e-38] * 16 + [0.0] * 16, [0.0] * 32], device=dev)
    for scaling in ("tensor", "row"):
        with pytest.raises(ValueError, match="global_encode_scale contains NaN or Inf"):
            quantize(tiny, formula="vllm", scaling=scaling)
        _same(quantize(tiny, formula="vllm", scaling=scaling, check=False),
              ref.quantize(tiny, formula="vllm", scaling=scaling, check=False))


def test_cast_tiles_fill_the_gpu_at_decode_sizes(monkeypatch):
    """Rows per program halve (down to 1, or 16 for 16x16 tiles) while the grid has fewer programs than two per
    SM; large operands keep their tiles, and so does any non-CUDA device. A program left with one row of 2048
    columns runs FEW_ROWS_WARPS warps."""
    qm = _quantize_module()
    monkeypatch.setattr(qm, "_programs_to_fill", lambda index: 264)
    dev = torch.device("cuda", 0)
    assert qm._fill_gpu(4, 256, 1, dev, 1) == 1        # a decode step's 256 rows: 256 programs, not 64
    assert qm._fill_gpu(2, 4096, 1, dev, 1) == 2       # 2048 programs already
    assert qm._fill_gpu(4, 600, 1, dev, 1) == 2        # 300 programs at 2 rows
    assert qm._fill_gpu(16, 64, 4, dev, 16) == 16      # 16x16 tiles keep 16 rows
    assert qm._fill_gpu(4, 256, 1, torch.device("cpu"), 1) == 4

    class Rows:  # what the row-scaled tiles read of an operand: its rows and its device
        def __init__(self, r):
            self.shape, self.device = (r, 0), dev

    # one row of 2048 columns per program because the rows are few: FEW_ROWS_WARPS; else the tile's own warps
    assert qm._tiles(Rows(64), 2048, False, True) == (1, 2048, qm.FEW_ROWS_WARPS, (64, 1))  # a decode norm cast
    assert qm._tiles(Rows(512), 768, False, True) == (1, 1024, 4, (512, 1))  # SiLU * up of 64 tokens x top-8
    assert qm._tiles(Rows(256), 1024, False, True)[2] == 4  # the small model's decode casts
    assert qm._tiles(Rows(16384), 2048, False, True)[2] == 4
    assert qm._tiles(Rows(64), 4096, False, True)[2] == 8  # wider rows: warps by width
