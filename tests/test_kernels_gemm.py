"""nvfp4_gemm / grouped_nvfp4_gemm: vs nvfp4_matmul_reference, batch invariance, groups, errors, dispatch."""
import pytest
import torch
from minite.kernels import (
    NVFP4Experts,
    _backend,
    blackwell,
    checks,
    gemm_path,
    grouped_nvfp4_gemm,
    nvfp4_gemm,
    stack_experts,
)

from minite import nvfp4 as ref

BACKENDS = ("triton", "torch")


def _q(m, k, scaling="row", scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ref.quantize(torch.randn(m, k, generator=g) * scale, scaling=scaling)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k,sa,sw", [(7, 40, 272, "row", "tensor"), (33, 17, 128, "tensor", "row"),
                                         (1, 64, 1040, "row", "row")])
def test_matches_reference(backend, m, n, k, sa, sw):
    a = ref.quantize(checks.spread_input(m, k, "cpu", seed=m), scaling=sa)
    w = _q(n, k, sw, 0.05, seed=1)
    r = ref.nvfp4_matmul_reference(a, w)
    o = nvfp4_gemm(a, w, out_dtype=torch.float32, backend=backend)
    assert o.shape == (m, n) and o.dtype == torch.float32
    assert checks.rel_err(o, r) < 1e-5
    bias = torch.randn(n)
    a = _q(m, k, sa, seed=m)  # moderate range: fp16 output must not overflow
    r = ref.nvfp4_matmul_reference(a, w)
    for dt in (torch.float16, torch.bfloat16):
        o = nvfp4_gemm(a, w, out_dtype=dt, bias=bias, backend=backend)
        assert o.dtype == dt and checks.rel_err(o, r + bias) < 1e-2
    o32 = nvfp4_gemm(a, w, out_dtype=torch.float32, bias=bias, backend=backend)
    assert checks.rel_err(o32, r + bias) < 1e-5


def test_torch_path_is_exact_reference():
    a, w = _q(5, 1024), _q(9, 1024, "tensor")
    assert torch.equal(nvfp4_gemm(a, w, out_dtype=torch.float32), ref.nvfp4_matmul_reference(a, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_and_determinism(backend):
    a, w = _q(70, 256), _q(48, 256, "tensor")
    full = nvfp4_gemm(a, w, out_dtype=torch.float32, backend=backend)
    assert torch.equal(full, nvfp4_gemm(a, w, out_dtype=torch.float32, backend=backend))
    for lo, hi in ((0, 1), (69, 70), (3, 36), (0, 64)):
        part = nvfp4_gemm(a.rows(lo, hi), w, out_dtype=torch.float32, backend=backend)
        assert torch.equal(part, full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_ragged_with_empty_groups(backend):
    e, n, k = 5, 24, 160
    ws = [_q(n, k, "row" if i % 2 else "tensor", seed=i) for i in range(e)]
    ws = [ref.NVFP4Tensor(w.codes, w.scales, w.row_global_scale().contiguous()) for w in ws]
    offs = torch.tensor([0, 5, 5, 40, 41, 41])
    a = _q(41, k, seed=9)
    out = grouped_nvfp4_gemm(a, ws, offs, out_dtype=torch.float32, backend=backend)
    stacked = grouped_nvfp4_gemm(a, stack_experts(ws), offs, out_dtype=torch.float32, backend=backend)
    assert torch.equal(out, stacked)
    for i in range(e):
        lo, hi = int(offs[i]), int(offs[i + 1])
        if hi > lo:
            r = ref.nvfp4_matmul_reference(a.rows(lo, hi), ws[i])
            assert checks.rel_err(out[lo:hi], r) < 1e-5
    # scalar expert global scales ([E]) too, and the bf16 default output
    ws2 = [_q(n, k, "tensor", seed=20 + i) for i in range(e)]
    o2 = grouped_nvfp4_gemm(a, ws2, offs, backend=backend)
    assert o2.dtype == torch.bfloat16
    r = ref.nvfp4_matmul_reference(a.rows(5, 40), ws2[2])
    assert checks.rel_err(o2[5:40], r) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_rows_read_in_place_equal_the_gathered_rows(backend):
    """``rows``: the sorted problem's row i is a[rows[i]] (tokens quantized once, each routed to several
    experts): bitwise the result of the gathered operand ``a.take(rows)``, int32 or int64 indices, and a
    per-row global scale taken with its row."""
    e, n, k, t = 4, 32, 256, 6
    ws = [_q(n, k, "tensor", seed=30 + i) for i in range(e)]
    a = _q(t, k, seed=3)  # per-row global scale
    rows = torch.tensor([0, 2, 5, 1, 2, 3, 4, 5, 0, 1, 3, 4])  # each token twice, sorted by expert
    offs = torch.tensor([0, 3, 3, 8, 12])
    want = grouped_nvfp4_gemm(a.take(rows), ws, offs, out_dtype=torch.float32, backend=backend)
    for idx in (rows, rows.to(torch.int32)):
        got = grouped_nvfp4_gemm(a, ws, offs, out_dtype=torch.float32, backend=backend, rows=idx)
        assert torch.equal(got, want)
    assert torch.equal(a.take(rows).global_scale, a.global_scale[rows])
    with pytest.raises(ValueError, match="end at M=12"):
        grouped_nvfp4_gemm(a, ws, torch.tensor([0, 3, 3, 8, 11]), backend=backend, rows=rows)
    with pytest.raises(ValueError, match="rows index outside"):
        grouped_nvfp4_gemm(a, ws, offs, backend=backend, rows=rows + 1)
    with pytest.raises(ValueError, match="rows must be"):
        grouped_nvfp4_gemm(a, ws, offs, backend=backend, rows=rows.float())


def test_grouped_all_rows_one_expert_and_zero_rows():
    k = 64
    ws = [_q(16, k, "tensor", seed=i) for i in range(3)]
    a = _q(10, k)
    out = grouped_nvfp4_gemm(a, ws, torch.tensor([0, 0, 10, 10]), out_dtype=torch.float32, backend="triton")
    assert torch.equal(out, nvfp4_gemm(a, ws[1], out_dtype=torch.float32, backend="triton"))
    empty = ref.NVFP4Tensor(a.codes[:0], a.scales[:0], a.global_scale[:0])
    assert grouped_nvfp4_gemm(empty, ws, torch.zeros(4, dtype=torch.int64), backend="triton").shape == (0, 16)


def test_bad_inputs():
    a, w = _q(4, 64), _q(8, 64)
    with pytest.raises(ValueError, match="K mismatch"):
        nvfp4_gemm(a, _q(8, 128))
    with pytest.raises(ValueError, match="out_dtype"):
        nvfp4_gemm(a, w, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="bias"):
        nvfp4_gemm(a, w, bias=torch.zeros(7))
    with pytest.raises(TypeError):
        nvfp4_gemm(torch.zeros(4, 64), w)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4_gemm(ref.NVFP4Tensor(a.codes, a.scales.float(), a.global_scale), w)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_gemm(ref.NVFP4Tensor(a.codes, a.scales, torch.ones(3)), w)
    with pytest.raises(ValueError, match="offsets"):
        grouped_nvfp4_gemm(a, [w, w], torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="offsets"):
        grouped_nvfp4_gemm(a, [w, w], torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="shapes differ"):
        grouped_nvfp4_gemm(a, [w, _q(4, 64)], torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="backend"):
        nvfp4_gemm(a, w, backend="cutlass")


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    assert _backend.resolve(None, cpu) == "torch"
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")
    assert _backend.resolve(None, cpu) == "triton"  # interpreter on (conftest)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _backend.resolve("triton", cpu)
    monkeypatch.setattr(_backend, "triton_available", lambda: (False, "ImportError: no triton"))
    with pytest.warns(RuntimeWarning, match="not importable"):
        assert _backend.resolve("triton", cpu) == "torch"
    a, w = _q(2, 32), _q(3, 32)
    assert torch.equal(nvfp4_gemm(a, w, out_dtype=torch.float32, backend="torch"),
                       ref.nvfp4_matmul_reference(a, w))


def test_blackwell_dispatch_with_mocked_capability(monkeypatch):
    monkeypatch.setattr(_backend, "triton_available", lambda: (True, ""))
    cuda = torch.device("cuda")
    for cap, want in (((10, 0), "blackwell"), ((10, 3), "blackwell"), ((9, 0), "triton"), ((8, 0), "triton")):
        monkeypatch.setattr(_backend, "capability", lambda d, c=cap: c)
        assert gemm_path(cuda) == want, cap
    monkeypatch.setenv("MINITE_KERNELS_BLACKWELL", "0")
    monkeypatch.setattr(_backend, "capability", lambda d: (10, 0))
    assert gemm_path(cuda) == "triton"
    assert gemm_path(torch.device("cpu")) == "torch"


def test_pdl_launch_arguments(monkeypatch):
    """Programmatic dependent launch: only for kernels that take the PDL flag (and wait first), only on CUDA
    sm_90+ outside the interpreter, and off with MINITE_KERNELS_PDL=0."""
    from minite.kernels._quantize_kernels import _cast_kernel, _dequant_kernel

    cuda = torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_backend, "capability", lambda d: (9, 0))
    assert _backend.pdl_meta(_cast_kernel, cuda) == {"PDL": True, "launch_pdl": True}
    assert _backend.pdl_meta(_dequant_kernel, cuda) == {}  # no PDL flag: a plain launch
    assert _backend.pdl_meta(_cast_kernel, torch.device("cpu")) == {}
    monkeypatch.setattr(_backend, "capability", lambda d: (8, 0))
    assert _backend.pdl_meta(_cast_kernel, cuda) == {}
    monkeypatch.setattr(_backend, "capability", lambda d: (9, 0))
    monkeypatch.setenv("MINITE_KERNELS_PDL", "0")
    assert _backend.pdl_meta(_cast_kernel, cuda) == {}
    monkeypatch.setenv("MINITE_KERNELS_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _backend.pdl_on(cuda)


@pytest.mark.parametrize("rows,cols", [(128, 4), (300, 130), (1, 1), (256, 8)])
def test_blackwell_scale_swizzle_round_trip(rows, cols):
    s = (torch.rand(rows, cols) * 400).to(torch.float8_e4m3fn)
    b = blackwell.to_blocked(s)
    assert b.numel() == -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert torch.equal(blackwell.from_blocked(b, rows, cols).view(torch.uint8), s.view(torch.uint8))
    # cuBLAS layout: inside a 128x4 tile, offset = (r % 32) * 16 + (r // 32) * 4 + c
    if rows >= 128 and cols >= 4:
        r, c = 77, 2
        assert b.view(torch.uint8)[(r % 32) * 16 + (r // 32) * 4 + c] == s.view(torch.uint8)[r, c]


def test_experts_container():
    ws = [_q(8, 32, "tensor", seed=i) for i in range(3)]
    ex = stack_experts(ws)
    assert isinstance(ex, NVFP4Experts) and ex.shape == (3, 8, 32) and ex.global_scale.shape == (3,)
    # a per-row expert beside scalar ones (fused gate/up shards whose scales happen to coincide collapse to a
    # scalar): the scalars are expanded to rows, and the grouped GEMM still equals each dense product
    row = _q(8, 32, "row")
    mixed = stack_experts([ws[0], row])
    assert mixed.global_scale.shape == (2, 8)
    assert torch.equal(mixed.global_scale[0], ws[0].global_scale.expand(8))
    assert torch.equal(mixed.global_scale[1], row.global_scale)
    a = _q(5, 32, "row", seed=7)
    out = grouped_nvfp4_gemm(a, [ws[0], row], torch.tensor([0, 2, 5]), out_dtype=torch.float32)
    want = torch.cat([ref.nvfp4_matmul_reference(a.rows(0, 2), ws[0]),
                      ref.nvfp4_matmul_reference(a.rows(2, 5), row)])
    assert torch.allclose(out, want, rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_gpu_gemm_vs_reference():
    res = checks.check_gemm(torch.device("cuda"))
    assert all(ok for _, ok, _ in res), [r for r in res if not r[1]]


@pytest.mark.gpu
def test_gpu_batch_invariance():
    res = checks.check_batch_invariance(torch.device("cuda"))
    assert all(ok for _, ok, _ in res), [r for r in res if not r[1]]


@pytest.mark.gpu
def test_gpu_grouped():
    res = checks.check_grouped(torch.device("cuda"))
    assert res[0][1], res


@pytest.mark.parametrize("variant", ("decode", "w16", "f16"))
def test_variants_bitwise_equal_interpreter(variant):
    """The three operand forms (decode in the loop / fp16 weight / both fp16) give the same bits."""
    from minite.kernels.gemm import prepare_weight
    a, w = _q(37, 400, seed=3), _q(40, 400, "tensor", seed=4)
    base = nvfp4_gemm(a, w, out_dtype=torch.float32, backend="triton")
    cfg = dict(BM=32, BN=32, GROUP_M=2, num_warps=4, num_stages=1, variant=variant)
    assert torch.equal(nvfp4_gemm(a, w, out_dtype=torch.float32, backend="triton", config=cfg), base)
    pw = prepare_weight(w, backend="triton")
    assert pw.f16.shape == (40, 512)
    assert torch.equal(nvfp4_gemm(a, pw, out_dtype=torch.float32, backend="triton", config=cfg), base)
    assert torch.equal(nvfp4_gemm(a, prepare_weight(w), out_dtype=torch.float32),
                       nvfp4_gemm(a, w, out_dtype=torch.float32))


def test_config_probe_accepts_equal_and_rejects_broken(monkeypatch):
    """The first-use probe (run on the GPU for real): a config that matches SAFE_CONFIG bit for bit is
    accepted; one that fails to build/run is rejected with a warning (and SAFE_CONFIG serves that M)."""
    from minite.kernels import gemm as G
    small = dict(BM=32, BN=32, GROUP_M=1, num_warps=4, num_stages=1, variant="decode")
    monkeypatch.setattr(G, "SAFE_CONFIG", small)
    ok_cfg = dict(BM=16, BN=64, GROUP_M=2, num_warps=4, num_stages=1, variant="f16")
    assert G._verify(ok_cfg, torch.device("cpu"), 40, 48, 272)
    with pytest.warns(RuntimeWarning, match="unusable"):
        assert not G._verify(dict(ok_cfg, variant="bogus"), torch.device("cpu"), 40, 48, 272)


@pytest.mark.parametrize("variant,bm,bn", [("decode32", 32, 32), ("small", 16, 64), ("w16w", 32, 32)])
@pytest.mark.parametrize("k", (400, 384))  # 384: K % 64 == 0, scales read as int32 words
def test_word_variants_bit_equal_interpreter(variant, bm, bn, k):
    """The word-load variants (kernels/_triton_gemm_w32.py): same bits as the default decode loop (K tail,
    bias, per-row scales), also for a prepared weight."""
    from minite.kernels.gemm import prepare_weight
    cfg = dict(BM=bm, BN=bn, GROUP_M=2, num_warps=4, num_stages=1, variant=variant)
    a, w = _q(37, k, seed=3), _q(70, k, "row", seed=4)
    bias = torch.randn(70)
    base = nvfp4_gemm(a, w, out_dtype=torch.float32, bias=bias, backend="triton")
    assert torch.equal(nvfp4_gemm(a, w, out_dtype=torch.float32, bias=bias, backend="triton", config=cfg), base)
    pw = prepare_weight(w, backend="triton")
    assert torch.equal(nvfp4_gemm(a, pw, out_dtype=torch.float32, bias=bias, backend="triton", config=cfg), base)
    one = nvfp4_gemm(a.rows(5, 6), w, out_dtype=torch.float32, bias=bias, backend="triton", config=cfg)
    assert torch.equal(one, base[5:6])


@pytest.mark.parametrize("variant", ("decode32", "f16", "w16w", "decode"))
@pytest.mark.parametrize("k", (160, 192))
def test_grouped_variants_bit_equal_interpreter(variant, k):
    """Grouped: every variant (packed or prepared experts) gives the bits of the default path (decode32:
    interpreter only, Triton 3.6 cannot build it)."""
    from minite.kernels import prepare_experts
    ws = [_q(24, k, "tensor", seed=i) for i in range(4)]
    offs = torch.tensor([0, 9, 9, 30, 41])
    a2 = _q(41, k, seed=8)
    cfg = dict(BM=32, BN=32, num_warps=4, num_stages=1, variant=variant)
    g0 = grouped_nvfp4_gemm(a2, ws, offs, out_dtype=torch.float32, backend="triton")
    g1 = grouped_nvfp4_gemm(a2, ws, offs, out_dtype=torch.float32, backend="triton", config=cfg)
    assert torch.equal(g0, g1)
    ex = prepare_experts(ws, backend="triton")
    assert ex.f16 is not None and ex.f16.shape == (4, 24, 256)
    assert torch.equal(grouped_nvfp4_gemm(a2, ex, offs, out_dtype=torch.float32, backend="triton"), g0)
    assert torch.equal(grouped_nvfp4_gemm(a2, ex, offs, out_dtype=torch.float32, backend="triton", config=cfg), g0)
    for i in range(4):
        lo, hi = int(offs[i]), int(offs[i + 1])
        if hi > lo:
            r = ref.nvfp4_matmul_reference(a2.rows(lo, hi), ws[i])
            assert checks.rel_err(g0[lo:hi], r) < 1e-5


def test_config_choice_by_shape():
    from minite.kernels import gemm as G
    assert G._configs(1, 8192, False)["variant"] == "small"
    assert G._configs(16, 4096, False)["variant"] == "small"
    assert G._configs(64, 4096, False) == G.SAFE_CONFIG
    assert G._configs(16384, 512, False) == G.MID_CONFIG
    assert G._configs(4096, 128, False) == G.TALL_CONFIG  # 32 tiles of 128x128 < 132 SMs
    assert G._configs(1024, 8192, False) == G.MID_CONFIG
    assert G._configs(16384, 8192, False) == G.BIG_CONFIG



def test_small_m_candidates_fall_back_in_order(monkeypatch):
    """M <= 16: SMALL_CONFIG if proven bit-equal, else SMALL_ALT_CONFIG, else SAFE_CONFIG (no GPU: the
    probe verdicts are stubbed)."""
    from minite.kernels import gemm as G
    dev = torch.device("cuda", 0)
    for verdicts, want in (({"SMALL": True}, G.SMALL_CONFIG), ({"ALT": True}, G.SMALL_ALT_CONFIG),
                           ({}, G.SAFE_CONFIG)):
        names = {id(G.SMALL_CONFIG): "SMALL", id(G.SMALL_ALT_CONFIG): "ALT"}

        def proven(c, d, v=verdicts):
            return any(v.get(k) for k, cfg in (("SMALL", G.SMALL_CONFIG), ("ALT", G.SMALL_ALT_CONFIG)) if c == cfg)
        monkeypatch.setattr(G, "_proven", proven)
        assert G._pick_config(1, 8192, dev) == want, names
    monkeypatch.setattr(G, "_proven", lambda c, d: True)
    assert G._pick_config(16, 512, dev) == G.SMALL_ALT_CONFIG  # narrow N: more, smaller programs first


def test_dense_weight_bytes_counts_the_form_read():
    """Codes + block scales + global scales where the GEMM reads the codes (CPU: always)."""
    from minite.kernels import dense_weight_bytes, prepare_weight
    w = _q(40, 256, "tensor")
    want = w.codes.numel() + w.scales.numel() + 4
    assert dense_weight_bytes(w, 64) == want
    assert dense_weight_bytes(prepare_weight(w, backend="triton"), 64) == want  # CPU tensors: the codes path


def test_gemm_reads_the_fp16_form_its_cast_wrote(monkeypatch):
    """A ``DecodedNVFP4Tensor`` (a norm-cast's codes with their fp16 form) goes to the fp16 GEMM as that form,
    with no decode pass of the tokens; the bits of the plain codes' GEMM (interpreter)."""
    from minite.kernels import DecodedNVFP4Tensor, prepare_weight, quantize_rms_norm
    from minite.kernels import gemm as G
    from minite.kernels.checks import spread_input
    x = spread_input(20, 256, "cpu", torch.bfloat16, seed=3)
    norm_w = spread_input(1, 256, "cpu", torch.bfloat16, seed=4)[0].abs() + 0.5
    _, a = quantize_rms_norm(x, norm_w, 1e-6, "hf", scaling="row", backend="triton", f16=True)
    assert isinstance(a, DecodedNVFP4Tensor) and a.f16.shape == (20, 256)
    w = prepare_weight(_q(48, 256, "row"), backend="triton")
    cfg = dict(BM=32, BN=32, GROUP_M=1, num_warps=4, num_stages=1, variant="f16")
    want = G._triton_dense(ref.NVFP4Tensor(a.codes, a.scales, a.global_scale), w, torch.float32, None, cfg)

    def no_token_decode(t):
        raise AssertionError("the tokens' fp16 form was decoded again")
    monkeypatch.setattr(G, "decode_f16", no_token_decode)
    assert torch.equal(G._triton_dense(a, w, torch.float32, None, cfg), want)
    assert not G.reads_f16_tokens(w, 64)  # CPU tensors: the codes path


def test_fp16_copy_at_decode_rows_needs_the_tokens_fp16_form(monkeypatch):
    """The pre-decoded config serves 17-64 rows of a wide weight only for tokens with their fp16 form (plain
    codes would need a decode pass first, which loses to the CUDA kernel): the dispatch rule alone."""
    from minite.kernels import gemm as G
    monkeypatch.setattr(G, "_proven", lambda cfg, device: True)
    cuda = torch.device("cuda", 0)

    def pick(m, n, tokens_f16):
        return G._pick_config(m, n, cuda, True, True, tokens_f16)["variant"]
    assert pick(64, 5120, True) == pick(17, G.F16_DECODE_MIN_N, True) == "f16"
    assert pick(64, 5120, False) == pick(16, 5120, True) == pick(64, G.F16_DECODE_MIN_N - 16, True) == "cuda"


@pytest.mark.gpu
def test_gpu_prepared_weight_reads_its_fp16_copy_at_decode_rows():
    """17-64 token rows that come with their fp16 form, over a wide weight with its fp16 copy, run the
    pre-decoded config; plain codes, 16 rows, or a narrow weight, the fragment-order codes; bits equal to the
    plain weight's at every size."""
    from minite.kernels import dense_weight_bytes, prepare_weight
    from minite.kernels import gemm as G
    from minite.kernels.weights import decode_layout
    dev = torch.device("cuda")
    w = ref.quantize(torch.randn(G.F16_DECODE_MIN_N, 2048, generator=torch.Generator().manual_seed(5)),
                     scaling="row")
    w = ref.NVFP4Tensor(w.codes.to(dev), w.scales.to(dev), w.global_scale.to(dev))
    pw = decode_layout(prepare_weight(w))
    a = ref.quantize(torch.randn(64, 2048, generator=torch.Generator().manual_seed(6)), scaling="row")
    a = ref.NVFP4Tensor(a.codes.to(dev), a.scales.to(dev), a.global_scale.to(dev))
    for m in (64, 17, 16, 1):
        sub = a.rows(0, m)
        assert G.config_for(sub, pw).startswith("cuda:"), (m, G.config_for(sub, pw))  # plain codes
        decoded = G.DecodedNVFP4Tensor(sub.codes, sub.scales, sub.global_scale, G.decode_f16(sub))
        form = "f16:" if m > 16 else "cuda:"
        assert G.config_for(decoded, pw).startswith(form), (m, G.config_for(decoded, pw))
        want = nvfp4_gemm(sub, w, out_dtype=torch.float32)
        assert torch.equal(nvfp4_gemm(sub, pw, out_dtype=torch.float32), want)
        assert torch.equal(nvfp4_gemm(decoded, pw, out_dtype=torch.float32), want)
    codes_bytes = w.codes.numel() + w.scales.numel() + w.global_scale.numel() * 4
    assert dense_weight_bytes(pw, 64, tokens_f16=True) == pw.f16.numel() * 2 + w.global_scale.numel() * 4
    assert dense_weight_bytes(pw, 64) == codes_bytes
    assert dense_weight_bytes(pw, 16, tokens_f16=True) == codes_bytes
    narrow = decode_layout(prepare_weight(ref.NVFP4Tensor(w.codes[:2048], w.scales[:2048], w.global_scale[:2048])))
    assert G.config_for(a, narrow).startswith("cuda:")
    # the norm-cast's fp16 form read in place of the tokens' decode pass, where (and only where) the GEMM reads it
    assert [G.reads_f16_tokens(pw, m) for m in (1, 16, 17, 64, 2048)] == [False, False, True, True, True]
    assert not G.reads_f16_tokens(narrow, 64)
    from minite.kernels import DecodedNVFP4Tensor, quantize_rms_norm
    from minite.kernels.checks import spread_input
    x = spread_input(64, 2048, dev, torch.bfloat16, seed=7)
    norm_w = spread_input(1, 2048, dev, torch.bfloat16, seed=8)[0].abs() + 0.5
    for m in (64, 17):
        _, t = quantize_rms_norm(x[:m], norm_w, 1e-6, "hf", scaling="row", f16=True)
        assert isinstance(t, DecodedNVFP4Tensor)
        plain = ref.NVFP4Tensor(t.codes, t.scales, t.global_scale)
        assert torch.equal(t.f16.view(torch.int16), G.decode_f16(plain).view(torch.int16))
        assert torch.equal(nvfp4_gemm(t, pw, out_dtype=torch.float32), nvfp4_gemm(plain, w, out_dtype=torch.float32))
