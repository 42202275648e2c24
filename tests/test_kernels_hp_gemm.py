"""invariant_gemm (the BF16 GEMM of hp_linear on log-prob paths): vs the exact float64 reference, batch
invariance (row i alone == row i inside M), split-K for narrow N, the first-use probe; GPU tests for the
same on CUDA (lm_head and router shapes) plus CUDA-graph capture."""
import pytest
import torch
from minite.kernels import _probe, hp_gemm
from minite.kernels.hp_gemm import invariant_gemm, reference_gemm

from minite.engines.decode_graphs import gc_paused
from minite.engines.gemm import hp_linear


def _xw(m, n, k, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    return x, w


def _close(y, ref):
    """fp32 accumulation vs exact: within a couple of output ulps."""
    assert (y.float() - ref.float()).abs().max() <= 2 * ref.float().abs().max() * 2 ** -8 + 1e-6


@pytest.mark.parametrize("m,n,k", [(37, 70, 200), (5, 128, 2048), (1, 33, 64), (64, 40, 1000), (17, 96, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_exact_reference(m, n, k, bias):
    x, w = _xw(m, n, k, seed=m)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    y = invariant_gemm(x, w, b, backend="triton")
    assert y.shape == (m, n) and y.dtype == x.dtype
    _close(y, reference_gemm(x, w, b))


@pytest.mark.parametrize("n,k", [(70, 200), (128, 2048)])  # one K range; 8 fixed K splits (router-like)
def test_batch_invariance_and_determinism(n, k):
    x, w = _xw(40, n, k, seed=3)
    full = invariant_gemm(x, w, backend="triton")
    assert torch.equal(full, invariant_gemm(x, w, backend="triton"))
    for lo, hi in ((0, 1), (39, 40), (3, 20), (0, 16)):
        assert torch.equal(invariant_gemm(x[lo:hi], w, backend="triton"), full[lo:hi]), (lo, hi)


def test_split_k_is_a_function_of_the_weight_only():
    assert hp_gemm.split_k(151936, 2048) == 1
    assert hp_gemm.split_k(128, 2048) == 8
    assert hp_gemm.split_k(2048, 2048) == 1
    assert hp_gemm.split_k(128, 200) == 1   # too short to split
    assert all(hp_gemm.split_k(n, 4096) >= 1 for n in (1, 7, 64, 1000))


def test_strided_and_fp16_inputs_and_fallbacks():
    x, w = _xw(12, 50, 96, seed=4)
    xt = x.t().contiguous().t()  # column-major x
    assert torch.equal(invariant_gemm(xt, w, backend="triton"), invariant_gemm(x, w, backend="triton"))
    xh, wh = _xw(12, 50, 96, dtype=torch.float16, seed=5)
    _close(invariant_gemm(xh, wh, backend="triton"), reference_gemm(xh, wh))
    xf = x.float()  # not bf16/fp16 (or mixed): the exact path
    assert torch.equal(invariant_gemm(xf, w.float(), backend="triton"), reference_gemm(xf, w.float()))
    assert torch.equal(invariant_gemm(x, w), reference_gemm(x, w))  # CPU auto: exact path
    assert invariant_gemm(x[:0], w, backend="triton").shape == (0, 50)


@pytest.mark.parametrize("n,k", [(70, 200), (128, 2048)])  # the wide store; and split K (a cast after)
def test_float32_out_holds_the_rounded_values(n, k):
    x, w = _xw(9, n, k, seed=8)
    want = invariant_gemm(x, w, backend="triton").float()
    got = invariant_gemm(x, w, backend="triton", out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(invariant_gemm(x, w, out_dtype=torch.float32), reference_gemm(x, w).float())
    with torch.no_grad():
        assert torch.equal(hp_linear(x, w, True, out_dtype=torch.float32), want)
    assert torch.equal(hp_linear(x, w, False, out_dtype=torch.float32), torch.nn.functional.linear(x, w).float())
    with pytest.raises(ValueError, match="out_dtype"):
        invariant_gemm(x, w, out_dtype=torch.float16)


def test_parts_summed_are_its_bits():
    x, w = _xw(9, 128, 2048, seed=9)  # the router's narrow N: 8 K splits
    parts = hp_gemm.invariant_gemm_parts(x, w, backend="triton")
    assert parts.shape == (8, 9, 128) and parts.dtype == torch.float32
    want = invariant_gemm(x, w, backend="triton")
    assert torch.equal(hp_gemm.sum_parts(parts, x.dtype), want)
    wide = hp_gemm.sum_parts(parts, x.dtype, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, want.float())
    acc = parts[0].clone()  # split order, fp32, one rounding: sum_parts' torch path does just this
    for s in range(1, 8):
        acc += parts[s]
    assert torch.equal(acc.to(x.dtype), want)
    assert hp_gemm.invariant_gemm_parts(*_xw(9, 70, 200), backend="triton") is None  # one K range
    assert hp_gemm.invariant_gemm_parts(x, w) is None                              # CPU auto: the exact path
    with pytest.raises(ValueError, match="expected x"):
        hp_gemm.invariant_gemm_parts(x, w[:, :8])


def test_hp_linear_parts_only_where_it_runs_the_invariant_gemm(monkeypatch):
    from minite.engines import gemm as engine_gemm

    x, w = _xw(5, 128, 2048, seed=10)
    monkeypatch.setattr(engine_gemm.kernels, "invariant_gemm_parts",
                        lambda x, w: hp_gemm.invariant_gemm_parts(x, w, backend="triton"))
    with torch.no_grad():
        parts = engine_gemm.hp_linear_parts(x, w, True)
        assert torch.equal(hp_gemm.sum_parts(parts, x.dtype), invariant_gemm(x, w, backend="triton"))
        assert engine_gemm.hp_linear_parts(x, w, False) is None        # a BF16 engine's cuBLAS path
    assert engine_gemm.hp_linear_parts(x, w, True) is None             # autograd on: cuBLAS


def test_hp_linear_uses_it_on_log_prob_paths_only():
    x, w = _xw(6, 24, 32, seed=6)
    x3 = x.reshape(2, 3, 32)
    with torch.no_grad():
        y = hp_linear(x3, w, invariant=True)
    assert y.shape == (2, 3, 24) and torch.equal(y.reshape(6, 24), invariant_gemm(x, w))
    xg = x3.clone().requires_grad_(True)
    assert torch.equal(hp_linear(xg, w, invariant=True).detach(), torch.nn.functional.linear(x3, w))


def test_bad_inputs():
    x, w = _xw(4, 8, 16)
    with pytest.raises(ValueError, match="expected x"):
        invariant_gemm(x, w[:, :8])
    with pytest.raises(ValueError, match="share a device"):
        invariant_gemm(x, w, torch.zeros(9, dtype=torch.bfloat16))


def test_probe_rejects_a_config_that_changes_bits(monkeypatch):
    calls = []

    def probe_false():
        calls.append(1)
        return False
    dev = torch.device("cpu")
    assert not _probe.proven("test:broken", dev, probe_false)
    assert not _probe.proven("test:broken", dev, probe_false) and len(calls) == 1  # cached
    assert _probe.proven("test:fine", dev, lambda: True)

    def probe_raises():
        raise RuntimeError("out of shared memory")
    with pytest.warns(RuntimeWarning, match="unusable here"):
        assert not _probe.proven("test:raises", dev, probe_raises)
    # an unproven candidate falls back to SAFE_CONFIG
    monkeypatch.setattr(hp_gemm, "_probe_config", lambda cfg, device, dtype: False)
    monkeypatch.setattr(_probe, "_verdicts", {})
    assert hp_gemm.pick_config(4, 1000, torch.device("cuda", 0)) == hp_gemm.SAFE_CONFIG


def test_decode_config_only_at_decode_rows_of_a_wide_weight():
    """The lm_head's decode config is a candidate at M <= 64 over a vocabulary-wide N only (the router's
    narrow N keeps its split-K tiles), and like every config it serves only once probed."""
    assert hp_gemm._configs(64, 151936) == (hp_gemm.DECODE_CONFIG,)
    assert hp_gemm._configs(16, 151936) == (hp_gemm.DECODE_CONFIG, hp_gemm.SMALL_CONFIG)
    assert hp_gemm._configs(64, 128) == () and hp_gemm._configs(16, 128) == (hp_gemm.SMALL_CONFIG,)
    assert hp_gemm.DECODE_CONFIG not in hp_gemm._configs(65, 151936)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(151936, 2048), (128, 2048), (4096, 2048)])
def test_gpu_batch_invariance_every_m_bucket(n, k):
    """Row i computed at M = 1, 8, 16, 17, 64, 256, 1000 equals row i inside M = 4096, and every row equals
    the SAFE_CONFIG result (whatever configs the probe admitted)."""
    x, w = _xw(4096, n, k, device="cuda", seed=7)
    full = invariant_gemm(x, w)
    safe = hp_gemm._launch(x, w, None, torch.empty_like(full), hp_gemm.SAFE_CONFIG, hp_gemm.split_k(n, k))
    assert torch.equal(full, safe)
    for m in (1, 8, 16, 17, 64, 256, 1000):
        for lo in (0, 4096 - m):
            assert torch.equal(invariant_gemm(x[lo:lo + m], w), full[lo:lo + m]), (m, lo)
    _close(full[:64], reference_gemm(x[:64], w))
    for m in (1, 64):  # the sampler's fp32 logits: the same values, stored wider
        assert torch.equal(invariant_gemm(x[:m], w, out_dtype=torch.float32), full[:m].float())
    print(hp_gemm.config_status())


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    x, w = _xw(16, 151936, 2048, device="cuda", seed=8)
    y = invariant_gemm(x, w)  # first use: compile + probe, outside the capture
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out = invariant_gemm(x, w)
    x.copy_(_xw(16, 151936, 2048, device="cuda", seed=9)[0])
    graph.replay()
    assert torch.equal(out, invariant_gemm(x, w)) and not torch.equal(out, y)
