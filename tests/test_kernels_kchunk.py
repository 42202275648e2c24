"""The K-chunk contract (``gemm.k_chunk``): every Triton variant follows it bit for bit (interpreter), the result
is the in-order fp32 sum of the chunk sums, rows do not depend on M; the switch itself; on the GPU the CUDA
decode kernel (chunk lanes over warps) equals the Triton kernels under it and stays batch invariant."""
import pytest
import torch
from minite.kernels import checks, grouped_nvfp4_gemm, nvfp4_gemm, prepare_experts, prepare_weight, stack_experts
from minite.kernels import gemm as G

from minite import nvfp4 as ref


def _q(m, k, scaling="row", seed=0, unit_global=False):
    """Random blocks of 16 spread over 2**-8 .. 2**8 (sums then round in fp32, so K orders differ)."""
    g = torch.Generator().manual_seed(seed)
    spread = 2.0 ** (torch.rand(m, -(-k // 16), generator=g) * 16 - 8)
    t = ref.quantize(torch.randn(m, k, generator=g) * spread.repeat_interleave(16, 1)[:, :k], scaling=scaling)
    if unit_global:  # the epilogue then only scales by 2**28: exact, so outputs add like the accumulators
        t = ref.NVFP4Tensor(t.codes, t.scales, torch.tensor(1.0))
    return t


def _cols(t, k0, k1):
    return ref.NVFP4Tensor(t.codes[:, k0 // 2:k1 // 2].contiguous(), t.scales[:, k0 // 16:k1 // 16].contiguous(),
                           t.global_scale)


@pytest.fixture
def chunk():
    """Run a test under K chunks of 256, then restore the switch."""
    G.set_k_chunk(256)
    yield 256
    G.set_k_chunk(None)


def test_switch_from_environment_and_setter(monkeypatch):
    monkeypatch.delenv(G.K_CHUNK_ENV, raising=False)
    assert G.k_chunk() == 0
    monkeypatch.setenv(G.K_CHUNK_ENV, "512")
    assert G.k_chunk() == 512
    G.set_k_chunk(0)
    try:
        assert G.k_chunk() == 0  # the setter wins over the environment
    finally:
        G.set_k_chunk(None)
    assert G.k_chunk() == 512
    for bad in (100, 384, -128):
        with pytest.raises(ValueError, match="K chunk"):
            G.set_k_chunk(bad)
    monkeypatch.setenv(G.K_CHUNK_ENV, "96")
    with pytest.raises(ValueError, match="K chunk"):
        G.k_chunk()


@pytest.mark.parametrize("k", (640, 592))  # 592: a K tail inside the last chunk
def test_result_is_the_in_order_sum_of_chunk_sums(chunk, k):
    """With unit global scales the output is 2**28 * acc exactly, so the chunked GEMM must equal
    ((0 + C0) + C1) + C2 where Ci is the one-chain GEMM of chunk i alone (K columns [256 i, 256 i + 256))."""
    a, w = _q(37, k, seed=3, unit_global=True), _q(40, k, "tensor", seed=4, unit_global=True)
    got = nvfp4_gemm(a, w, out_dtype=torch.float32, backend="triton")
    G.set_k_chunk(0)
    want = torch.zeros(37, 40)
    for k0 in range(0, k, chunk):
        want = want + nvfp4_gemm(_cols(a, k0, min(k0 + chunk, k)), _cols(w, k0, min(k0 + chunk, k)),
                                 out_dtype=torch.float32, backend="triton")
    assert torch.equal(got, want)
    # the contracts differ (fp32 rounding of the partial sums): the switch really changes the K order
    assert not torch.equal(got, nvfp4_gemm(a, w, out_dtype=torch.float32, backend="triton"))
    assert checks.rel_err(got, ref.nvfp4_matmul_reference(a, w)) < 1e-5


@pytest.mark.parametrize("variant,bm,bn", [("decode", 32, 32), ("w16", 32, 32), ("f16", 32, 32), ("decode32", 32, 32),
                                           ("small", 16, 64), ("w16w", 32, 32)])
def test_every_variant_follows_the_chunks_bit_for_bit(chunk, variant, bm, bn):
    """All operand forms and tile shapes give the chunked default's bits (bias, per-row scales, a K tail; the
    prepared weight too); a row alone equals itself inside the batch."""
    a, w = _q(37, 592, seed=5), _q(70, 592, "row", seed=6)
    bias = torch.randn(70)
    base = nvfp4_gemm(a, w, out_dtype=torch.float32, bias=bias, backend="triton")
    cfg = dict(BM=bm, BN=bn, GROUP_M=2, num_warps=4, num_stages=1, variant=variant)
    assert torch.equal(nvfp4_gemm(a, w, out_dtype=torch.float32, bias=bias, backend="triton", config=cfg), base)
    pw = prepare_weight(w, backend="triton")
    assert torch.equal(nvfp4_gemm(a, pw, out_dtype=torch.float32, bias=bias, backend="triton", config=cfg), base)
    one = nvfp4_gemm(a.rows(5, 6), w, out_dtype=torch.float32, bias=bias, backend="triton", config=cfg)
    assert torch.equal(one, base[5:6])


@pytest.mark.parametrize("variant", ("decode", "f16", "decode32", "w16w"))
def test_grouped_variants_follow_the_chunks(chunk, variant):
    """Grouped (empty groups, per-row expert scales): every variant gives the chunked dense GEMM's bits on each
    expert's rows."""
    ws = [_q(24, 640, "row" if i % 2 else "tensor", seed=i) for i in range(4)]
    ws = [ref.NVFP4Tensor(x.codes, x.scales, x.row_global_scale().contiguous()) for x in ws]
    offs = torch.tensor([0, 9, 9, 30, 41])
    a = _q(41, 640, seed=8)
    cfg = dict(BM=32, BN=32, num_warps=4, num_stages=1, variant=variant)
    ex = prepare_experts(ws, backend="triton") if variant in ("f16", "w16w") else stack_experts(ws)
    got = grouped_nvfp4_gemm(a, ex, offs, out_dtype=torch.float32, backend="triton", config=cfg)
    for i in range(4):
        lo, hi = int(offs[i]), int(offs[i + 1])
        if hi > lo:
            dense = nvfp4_gemm(a.rows(lo, hi), ws[i], out_dtype=torch.float32, backend="triton")
            assert torch.equal(got[lo:hi], dense), i


def test_decode_configs_under_chunks(chunk, monkeypatch):
    """Under chunks the CUDA decode kernel spreads a row group's chunks over warps (C lanes); the grouped one
    keeps one lane. The probe verdicts are kept per K order (no GPU here: verdicts stubbed)."""
    assert G.cuda_config(1)["C"] > 1 and G.cuda_config(64)["C"] > 1
    assert G.grouped_cuda_config(8, 128).get("C", 1) == 1
    assert G.config_name(G.cuda_config(1)).endswith("c4")
    seen = []
    monkeypatch.setattr(G, "_verify", lambda cfg, dev: seen.append((G.k_chunk(), G.config_name(cfg))) or True)
    monkeypatch.setattr(G, "_verified", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    dev = torch.device("cuda", 0)
    cfg = dict(G.SMALL_ALT_CONFIG)
    assert G._proven(cfg, dev)
    G.set_k_chunk(0)
    assert G._proven(cfg, dev)  # a new K order: probed again
    assert [kc for kc, _ in seen] == [256, 0]
    assert set(G.config_status()) == {G.config_name(cfg) + " kc256", G.config_name(cfg)}


# ----------------------------------------------------------------------------------------------- GPU
def _gpu():
    dev = torch.device("cuda")
    if G._cuda_module(dev) is None:
        pytest.skip("the CUDA decode kernel is not built here (no nvcc, or disabled)")
    return dev


CHUNK_CONFIGS = [dict(variant="cuda", NT=nt, W=w, D=d, SEG=0, C=c) for nt, w, d, c in
                 ((1, 4, 8, 1), (1, 4, 8, 4), (1, 8, 8, 4), (1, 8, 8, 8), (2, 8, 8, 2), (1, 8, 4, 2), (4, 8, 8, 1))]
# Not listed: NT=2 with C=4 chunk lanes, which the H200 probe found NOT bit-equal under K chunks (the product's
# first-use probe rejects them; K chunks are off by default), and NT=2 W=8 D=16 C=4, whose token segments do
# not fit the H200's shared memory at K = 2176 (the product falls back to Triton for such a config).


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CHUNK_CONFIGS, ids=G.config_name)
def test_gpu_chunked_cuda_bit_equal_to_triton(cfg):
    """K chunks of 512 over warps: every config, every decode M, K with a short last chunk (2176) and in token
    segments, fp32 / bf16 / fp16 with a bias: bitwise the Triton safe config under the same chunks, and the
    in-order sum of the chunk sums."""
    dev = _gpu()
    from minite.kernels import quantize
    G.set_k_chunk(512)
    try:
        g = torch.Generator().manual_seed(1)
        a = quantize(torch.randn(64, 2176, generator=g).to(dev), scaling="row")
        w = quantize((torch.randn(1536, 2176, generator=g) * 0.05).to(dev))
        bias = torch.randn(1536, generator=g).to(dev)
        for m in (1, 2, 5, 8, 16, 33, 64):
            sub = a.rows(0, m)
            got = nvfp4_gemm(sub, w, out_dtype=torch.float32, config=cfg)
            assert torch.equal(got, nvfp4_gemm(sub, w, out_dtype=torch.float32, config=G.SAFE_CONFIG)), m
            for dt in (torch.bfloat16, torch.float16):
                assert torch.equal(nvfp4_gemm(sub, w, out_dtype=dt, bias=bias, config=cfg),
                                   nvfp4_gemm(sub, w, out_dtype=dt, bias=bias, config=G.SAFE_CONFIG)), (m, dt)
        au = ref.NVFP4Tensor(a.codes[:8], a.scales[:8], torch.tensor(1.0, device=dev))
        wu = ref.NVFP4Tensor(w.codes, w.scales, torch.tensor(1.0, device=dev))
        got = nvfp4_gemm(au, wu, out_dtype=torch.float32, config=cfg)
        G.set_k_chunk(0)
        want = torch.zeros_like(got)
        for k0 in range(0, 2176, 512):
            k1 = min(k0 + 512, 2176)
            want = want + nvfp4_gemm(_cols(au, k0, k1), _cols(wu, k0, k1), out_dtype=torch.float32,
                                     config=G.SAFE_CONFIG)
        assert torch.equal(got, want)
    finally:
        G.set_k_chunk(None)


@pytest.mark.gpu
def test_gpu_chunked_default_is_batch_invariant():
    """Under K chunks the default path at M = 1..64 (the CUDA kernel, chunk lanes) gives the rows of M = 16384
    (the large-M Triton path with a second accumulator) bitwise; grouped decode equals the grouped loop."""
    dev = _gpu()
    from minite.kernels import quantize
    from minite.kernels.bench import moe_offsets
    G.set_k_chunk(512)
    try:
        a = quantize(torch.randn(16384, 2048, device=dev), scaling="row")
        w = quantize(torch.randn(1024, 2048, device=dev))
        full = nvfp4_gemm(a, w, out_dtype=torch.float32)
        for m in (1, 2, 4, 8, 16, 32, 64):
            assert torch.equal(nvfp4_gemm(a.rows(100, 100 + m), w, out_dtype=torch.float32), full[100:100 + m]), m
        assert G.config_status().get(G.config_name(G.cuda_config(1)) + " kc512") is True
        offs = moe_offsets(8, 128, 8, dev, align=1)
        x = quantize(torch.randn(int(offs[-1]), 768, device=dev), scaling="row")
        ex = stack_experts([quantize(torch.randn(256, 768, device=dev)) for _ in range(128)])
        assert torch.equal(grouped_nvfp4_gemm(x, ex, offs, out_dtype=torch.float32),
                           grouped_nvfp4_gemm(x, ex, offs, out_dtype=torch.float32, config=G.GROUPED_FALLBACK))
    finally:
        G.set_k_chunk(None)
