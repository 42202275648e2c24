"""Fused non-GEMM ops: every Triton kernel (the interpreter here, CUDA on a GPU) is bitwise its op-by-op
PyTorch reference, and the "hf" references are transformers' own modules op for op."""
import pytest
import torch
from minite.kernels import fused_ops as F

MODES = ["hf", "vllm"]


def _same(a, b):
    """Bitwise equality (NaN-safe, sign of zero included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    ia = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    bad = (ia != ib).sum().item()
    assert bad == 0, f"{bad} of {a.numel()} values differ"


def _rand(shape, seed, device="cpu", dtype=torch.bfloat16, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * spread
    x = x * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())  # wide magnitudes: rounding cases
    return x.to(device=device, dtype=dtype)


def _cos_sin(b, t, d, mode, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(b, t, d // 2, generator=g) * 50
    ang = torch.cat([ang, ang], dim=-1)
    if mode == "hf":
        return ang.cos().to(device, torch.bfloat16), ang.sin().to(device, torch.bfloat16)
    return ang.cos()[:, None].to(device), ang.sin()[:, None].to(device)


# ------------------------------------------------------------------------------------------- references
def test_hf_references_are_transformers_modules():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

    x = _rand((3, 5, 64), 1)
    norm = Qwen3MoeRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_rand((64,), 2))
    _same(F.rms_norm_reference(x, norm.weight.detach(), 1e-6, "hf"), norm(x).detach())
    q, k = _rand((2, 4, 3, 32), 3), _rand((2, 2, 3, 32), 4)
    cos, sin = _cos_sin(2, 3, 32, "hf", 5)
    for got, want in zip(F.rope_reference(q, k, cos, sin, "hf"), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        _same(got, want)
    g, u = _rand((7, 48), 6), _rand((7, 48), 7)
    _same(F.silu_mul_reference(g, u, "hf"), torch.nn.functional.silu(g) * u)


# ------------------------------------------------------------------------------------------- kernels
def _check_rms_norm(mode, rows, n, device, seed=0):
    x = _rand((rows, 1, n), seed, device)
    res = _rand((rows, 1, n), seed + 1, device, spread=4.0)
    w = _rand((n,), seed + 2, device)
    _same(F.rms_norm(x, w, 1e-6, mode, backend="triton"), F.rms_norm_reference(x, w, 1e-6, mode))
    got, want = F.rms_norm(x, w, 1e-6, mode, residual=res, backend="triton"), \
        F.rms_norm_reference(x, w, 1e-6, mode, residual=res)
    _same(got[0], want[0])
    _same(got[1], want[1])


@pytest.mark.parametrize("mode", MODES)
def test_rms_norm_kernel_equals_reference(mode):
    _check_rms_norm(mode, 5, 96, "cpu")
    _check_rms_norm(mode, 3, 200, "cpu", seed=9)  # width not a power of two


def _check_qk(mode, b, t, nq, nkv, d, device, seed=0, cache_slots=None):
    qkv = _rand((b, t, (nq + 2 * nkv) * d), seed, device)
    qw, kw = _rand((d,), seed + 1, device), _rand((d,), seed + 2, device)
    cos, sin = _cos_sin(b, t, d, mode, seed + 3, device)
    cache_ref = cache_got = None
    if cache_slots is not None:
        s = cache_slots
        kc = torch.zeros(s, nkv, t + 4, d, dtype=torch.bfloat16, device=device)
        slots = torch.randperm(s, generator=torch.Generator().manual_seed(seed))[:b].to(device)
        pos = (torch.arange(t)[None, :] + torch.arange(b)[:, None] % 3).to(device)
        cache_ref = (kc.clone(), kc.clone(), slots, pos)
        cache_got = (kc.clone(), kc.clone(), slots, pos)
    want = F.qk_norm_rope_reference(qkv, nq, nkv, qw, kw, 1e-6, cos, sin, mode, cache_ref)
    got = F.qk_norm_rope(qkv, nq, nkv, qw, kw, 1e-6, cos, sin, mode, cache_got, backend="triton")
    for g, w in zip(got, want, strict=True):
        _same(g, w)
        assert [st for st, n in zip(g.stride(), g.shape, strict=True) if n > 1] == \
            [st for st, n in zip(w.stride(), w.shape, strict=True) if n > 1]  # the reference's layout
    if cache_slots is not None:
        _same(cache_got[0], cache_ref[0])
        _same(cache_got[1], cache_ref[1])


@pytest.mark.parametrize("mode", MODES)
def test_qk_norm_rope_kernel_equals_reference_and_writes_the_cache(mode):
    _check_qk(mode, 2, 3, 4, 2, 32, "cpu")
    _check_qk(mode, 3, 1, 4, 2, 32, "cpu", seed=5, cache_slots=5)  # a decode step into slots 0..4
    _check_qk(mode, 2, 3, 2, 1, 16, "cpu", seed=7, cache_slots=2)  # a prefill
    _check_qk(mode, 2, 1, 2, 1, 48, "cpu", seed=9, cache_slots=2)  # head dim 48: the reference (no crash)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-g) = inf for very negative g, as on GPU
def test_silu_mul_kernel_equals_reference(mode):
    h = _rand((6, 2 * 1100), 3, spread=3.0)   # the two halves of one projection, wider than one block
    gate, up = h.chunk(2, dim=-1)
    _same(F.silu_mul(gate, up, mode, backend="triton"), F.silu_mul_reference(gate, up, mode))


@pytest.mark.parametrize("mode", MODES)
def test_combine_experts_kernel_equals_reference(mode):
    t, k, h = 5, 3, 40
    y = _rand((t * k, h), 4)
    perm = torch.randperm(t * k, generator=torch.Generator().manual_seed(1))
    w = torch.softmax(torch.randn(t, k, generator=torch.Generator().manual_seed(2)), -1)
    w = w.to(torch.bfloat16) if mode == "hf" else w
    _same(F.combine_experts(y, perm, w, mode, backend="triton"), F.combine_experts_reference(y, perm, w, mode))


@pytest.mark.parametrize("t,k,e", [(5, 3, 8), (64, 8, 128), (40, 2, 5)])
def test_sort_by_expert_is_the_stable_sort(t, k, e):
    g = torch.Generator().manual_seed(t + e)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[ids == 1] = 0  # an expert nobody picks
    got, want = F.sort_by_expert(ids, e, backend="triton"), F.sort_by_expert_reference(ids, e)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


def test_bad_mode_and_unsupported_dtypes():
    x = _rand((2, 16), 0)
    with pytest.raises(ValueError, match="non-GEMM numerics"):
        F.rms_norm(x, x[0], 1e-6, "fp8")
    w32 = torch.ones(16)  # a weight in another dtype than x: the reference's promotion, not the kernel
    _same(F.rms_norm(x, w32, 1e-6, "hf", backend="triton"), F.rms_norm_reference(x, w32, 1e-6, "hf"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_mean_is_a_call_of_at_least_16_rows(monkeypatch, backend):
    """torch's CUDA mean orders a row's sum by the call's row count below 16 rows (module docstring), so the
    norms of a small decode batch take theirs in a call of >= 16 rows; values unchanged (CPU: row by row)."""
    want_norm = F.rms_norm(_rand((3, 1, 256), 1), _rand((256,), 2), 1e-6, "hf", backend=backend)
    want_qk = F.qk_norm_rope(_rand((1, 1, 6 * 32), 3), 4, 1, _rand((32,), 4), _rand((32,), 5), 1e-6,
                             *_cos_sin(1, 1, 32, "hf", 6), "hf", backend=backend)
    rows, mean = [], torch.Tensor.mean

    def recording_mean(t, *args, **kwargs):
        rows.append(t.numel() // t.shape[-1])
        return mean(t, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "mean", recording_mean)
    for mode in MODES:
        got = F.rms_norm(_rand((3, 1, 256), 1), _rand((256,), 2), 1e-6, mode, residual=_rand((3, 1, 256), 7),
                         backend=backend)
        assert got[0].shape == got[1].shape == (3, 1, 256)
    got_norm = F.rms_norm(_rand((3, 1, 256), 1), _rand((256,), 2), 1e-6, "hf", backend=backend)
    got_qk = F.qk_norm_rope(_rand((1, 1, 6 * 32), 3), 4, 1, _rand((32,), 4), _rand((32,), 5), 1e-6,
                            *_cos_sin(1, 1, 32, "hf", 6), "hf", backend=backend)
    # three norms, then q/k: one call for both on the fused path (rows of q, then k), two in the reference
    assert len(rows) == (4 if backend == "triton" else 5) and min(rows) >= 16, rows
    _same(got_norm, want_norm)
    for g, w in zip(got_qk, want_qk, strict=True):
        _same(g, w)


# ------------------------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_norm_rows_do_not_depend_on_the_batch(mode):
    """A decode batch of 1-15 rows normalises each row as a 64-row call (the trainer's) does, and in "hf" as
    transformers' module over those 64 rows. torch's own mean of fewer rows sums in another order at 2048
    wide (the first check); ``row_mean`` does not. (A last-bit change of the mean seldom reaches the BF16
    output, so the variance is compared itself.)"""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    x, res, w = _rand((64, 1, 2048), 0, "cuda"), _rand((64, 1, 2048), 1, "cuda", spread=4.0), _rand((2048,), 2, "cuda")
    sq = x.float().pow(2)
    assert any(not torch.equal(sq[:n].mean(-1, keepdim=True), sq.mean(-1, keepdim=True)[:n]) for n in (1, 3, 8, 15))
    for n in (1, 3, 8, 15):
        assert torch.equal(F.row_mean(sq[:n]), sq.mean(-1, keepdim=True)[:n]), n
    norm = Qwen3MoeRMSNorm(2048, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
    full, full_res = F.rms_norm(x, w, 1e-6, mode), F.rms_norm(x, w, 1e-6, mode, residual=res)
    if mode == "hf":
        _same(full, norm(x).detach())
    for n in (1, 3, 8, 15):
        for backend in ("triton", "torch"):
            _same(F.rms_norm(x[:n], w, 1e-6, mode, backend=backend), full[:n])
            got = F.rms_norm(x[:n], w, 1e-6, mode, residual=res[:n], backend=backend)
            _same(got[0], full_res[0][:n])
            _same(got[1], full_res[1][:n])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fused_ops_bitwise_at_qwen3_30b_a3b_widths(mode):
    """CUDA's expf / rsqrtf / IEEE division and no FMA: the kernels equal torch's CUDA ops, bit for bit."""
    for seed in range(3):
        _check_rms_norm(mode, 64, 2048, "cuda", seed=seed)
        _check_rms_norm(mode, 37, 2048, "cuda", seed=seed + 10)
        _check_qk(mode, 64, 1, 32, 4, 128, "cuda", seed=seed, cache_slots=80)
        _check_qk(mode, 4, 33, 32, 4, 128, "cuda", seed=seed + 5, cache_slots=4)
        h = _rand((512, 2 * 768), seed, "cuda", spread=4.0)
        gate, up = h.chunk(2, dim=-1)
        _same(F.silu_mul(gate, up, mode), F.silu_mul_reference(gate, up, mode))
        t, k = 64, 8
        y = _rand((t * k, 2048), seed, "cuda")
        perm = torch.randperm(t * k, device="cuda")
        w = torch.softmax(torch.randn(t, k, device="cuda"), -1)
        w = w.to(torch.bfloat16) if mode == "hf" else w
        _same(F.combine_experts(y, perm, w, mode), F.combine_experts_reference(y, perm, w, mode))
        ids = torch.topk(torch.randn(t * 32, 128, device="cuda"), k, dim=-1).indices  # a prefill's routing too
        for rows in (ids[:t], ids):
            for a, b in zip(F.sort_by_expert(rows, 128), F.sort_by_expert_reference(rows, 128), strict=True):
                assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------- means in the pass
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,with_res", [(128, False), (256, True), (384, True)])
def test_square_pass_takes_torchs_mean_itself(mode, n, with_res):
    """The square pass's own mean (the interpreter) is the emulated order of torch's CUDA mean, bitwise, and
    the residual sum it writes is the reference's."""
    x, res = _rand((7, n), 1), _rand((7, n), 2, spread=4.0) if with_res else None
    hf = mode == "hf"
    summed = None if res is None else torch.empty(7, n, dtype=x.dtype if hf else torch.float32)
    var = F.square_mean(x, res, summed, mode)
    src = x.float() if res is None else (res + x).float() if hf else res.float() + x.float()
    _same(var, F.row_mean_emulated(src.pow(2)))
    if res is not None:
        _same(summed, (res + x) if hf else res.float() + x.float())


def test_emulated_mean_order():
    """Lanes of four elements each, combined in halves (lane 0 meets lane 2 before lane 1): 1.0 survives,
    where a sum in index order, or lanes in adjacent pairs, loses it to 2^30."""
    t = torch.zeros(1, 128)
    t[0, 0], t[0, 4], t[0, 8] = 2.0**30, 1.0, -(2.0**30)  # lanes 0, 1, 2
    assert F.row_mean_emulated(t).item() == 1.0 / 128
    with pytest.raises(ValueError):
        F.row_mean_emulated(torch.ones(2, 100))
    assert not F.mean_in_pass(2048, torch.device("cpu"))  # CPU: torch's own order


@pytest.mark.parametrize("mode", MODES)
def test_norms_with_means_in_the_pass_equal_the_emulated_reference(monkeypatch, mode):
    """The fused norm and q/k norm with the mean taken in their square pass (forced on here, the interpreter)
    equal the references with torch's CUDA mean order (``row_mean_emulated``): what they are on the GPU."""
    monkeypatch.setattr(F, "mean_in_pass", lambda n, device: n % 128 == 0)
    monkeypatch.setattr(F, "row_mean", lambda t: F.row_mean_emulated(t.reshape(-1, t.shape[-1])).reshape(
        *t.shape[:-1], 1))
    x, w, res = _rand((2, 3, 256), 1), _rand((256,), 2), _rand((2, 3, 256), 3, spread=4.0)
    _same(F.rms_norm(x, w, 1e-6, mode, backend="triton"), F.rms_norm_reference(x, w, 1e-6, mode))
    for g, r in zip(F.rms_norm(x, w, 1e-6, mode, residual=res, backend="triton"),
                    F.rms_norm_reference(x, w, 1e-6, mode, residual=res), strict=True):
        _same(g, r)
    qkv = _rand((2, 1, 4 * 128), 4)
    args = (2, 1, _rand((128,), 5), _rand((128,), 6), 1e-6, *_cos_sin(2, 1, 128, mode, 7), mode)
    for g, r in zip(F.qk_norm_rope(qkv, *args, backend="triton"), F.qk_norm_rope_reference(qkv, *args),
                    strict=True):
        _same(g, r)


def _routed(mode, t, k, n, seed, device="cpu"):
    """(RoutedRows of t tokens x k experts, their combine): the experts' rows of wide magnitudes."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(t)]).to(device)
    perm, _, _, inv = F.sort_by_expert_reference(ids, 16, inverse=True)
    y = _rand((t * k, n), seed, device, spread=8.0)
    w = torch.rand(t, k, generator=g).to(device, torch.bfloat16 if mode == "hf" else torch.float32)
    combined = F.combine_experts_emulated(y, inv, w, mode) if device == "cpu" else \
        F.combine_experts_reference(y, perm, w, mode)
    return F.RoutedRows(y, perm, inv, w, mode, (t, 1, n)), combined.view(t, 1, n)


def _launches(monkeypatch):
    names = []
    launch = F._launch
    monkeypatch.setattr(F, "_launch", lambda kernel, *a, **k: names.append(kernel.fn.__name__) or launch(kernel, *a,
                                                                                                         **k))
    return names


@pytest.mark.parametrize("mode", MODES)
def test_norm_takes_the_experts_combine_in_its_one_pass(monkeypatch, mode):
    """With the mean in the pass (forced on, the interpreter) a norm is one launch, and given the experts'
    ``RoutedRows`` (the one-pass combine forced on too) that launch takes their combine first: the norm of
    the emulated combine, bitwise, with and without a residual."""
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")
    monkeypatch.setattr(F, "mean_in_pass", lambda n, device: n % 128 == 0)
    torch_mean = F.row_mean
    monkeypatch.setattr(F, "row_mean", lambda t: F.row_mean_emulated(t.reshape(-1, t.shape[-1])).reshape(
        *t.shape[:-1], 1))
    monkeypatch.setattr(F, "combine_in_one_pass", lambda y, w, mode: True)
    names = _launches(monkeypatch)
    routed, combined = _routed(mode, 5, 6, 256, 1)
    w, res = _rand((256,), 2), _rand((5, 1, 256), 3, spread=4.0)
    _same(F.rms_norm(routed, w, 1e-6, mode), F.rms_norm_reference(combined, w, 1e-6, mode))
    for g, r in zip(F.rms_norm(routed, w, 1e-6, mode, residual=res),
                    F.rms_norm_reference(combined, w, 1e-6, mode, residual=res), strict=True):
        _same(g, r)
    assert names == ["_norm_row_kernel"] * 2
    names.clear()  # a width the pass's mean does not cover: the combine first, then the two-pass norm
    monkeypatch.setattr(F, "row_mean", torch_mean)
    routed, combined = _routed(mode, 3, 2, 96, 4)
    _same(F.rms_norm(routed, w[:96], 1e-6, mode), F.rms_norm_reference(combined, w[:96], 1e-6, mode))
    assert names[0] == "_gather_combine_kernel" and "_norm_row_kernel" not in names
    assert routed.reshape(-1, 96).shape == (3, 96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_square_pass_means_are_torchs():
    """On the GPU the emulated order is torch's mean (any row count from 16), and the norms use it."""
    from minite.kernels import _probe

    for n in (128, 768, 2048, 4096):
        for rows in (16, 64, 1000):
            sq = _rand((rows, n), n + rows, "cuda").float().pow(2)
            _same(F.row_mean_emulated(sq), sq.mean(-1, keepdim=True))
        assert F.mean_in_pass(n, torch.device("cuda")), _probe.verdicts("('row_mean'")


# ------------------------------------------------------------------------------------------- one-pass combine
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t,k", [(5, 8), (3, 6), (4, 1)])
def test_gather_combine_kernel_equals_its_emulation(mode, t, k):
    """The gathered combine (the interpreter) is its PyTorch emulation bitwise; the sort's inverse is perm's."""
    g = torch.Generator().manual_seed(t * k)
    ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(t)])
    perm, rows, offs, inv = F.sort_by_expert(ids, 16, backend="triton", inverse=True)
    want = F.sort_by_expert_reference(ids, 16, inverse=True)
    for a, b in zip((perm, rows, offs, inv), want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(perm[inv], torch.arange(t * k))
    y = _rand((t * k, 1100), 3, spread=8.0)
    w = torch.rand(t, k, generator=g).to(torch.bfloat16 if mode == "hf" else torch.float32)
    _same(F._gather_combine(y, inv, w, mode), F.combine_experts_emulated(y, inv, w, mode))
    assert not F.combine_in_one_pass(y, w, mode)  # CPU: the scatter and torch's sum


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_one_pass_combine_is_torchs(mode):
    """On the GPU the emulated order is torch's sum over k, the probe passes, and combine_experts with the
    sort's inverse equals its reference bitwise (products of wide magnitudes, both signs)."""
    for t, k, seed in ((64, 8, 0), (1, 8, 1), (200, 8, 2), (64, 6, 3)):
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(128, generator=g)[:k] for _ in range(t)]).cuda()
        perm, _, _, inv = F.sort_by_expert(ids, 128, inverse=True)
        y = _rand((t * k, 2048), seed, "cuda", spread=8.0)
        w = torch.rand(t, k, generator=g).to("cuda", torch.bfloat16 if mode == "hf" else torch.float32)
        want = F.combine_experts_reference(y, perm, w, mode)
        _same(F.combine_experts_emulated(y, inv, w, mode), want)
        assert F.combine_in_one_pass(y, w, mode)
        _same(F.combine_experts(y, perm, w, mode, inv=inv), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_one_pass_norm_and_the_combine_in_it(mode):
    """On the GPU at Qwen3-30B-A3B's width: the one-pass norm is the reference, and given the experts' rows
    it takes their combine (torch's sum over k) in the same launch, bitwise."""
    for t, seed in ((64, 0), (7, 1), (300, 2)):
        _check_rms_norm(mode, t, 2048, "cuda", seed=seed)
        routed, combined = _routed(mode, t, 8, 2048, seed, "cuda")
        assert routed.fusable()
        w, res = _rand((2048,), seed + 1, "cuda"), _rand((t, 1, 2048), seed + 2, "cuda", spread=4.0)
        _same(F.rms_norm(routed, w, 1e-6, mode), F.rms_norm_reference(combined, w, 1e-6, mode))
        for g, r in zip(F.rms_norm(routed, w, 1e-6, mode, residual=res),
                        F.rms_norm_reference(combined, w, 1e-6, mode, residual=res), strict=True):
            _same(g, r)
