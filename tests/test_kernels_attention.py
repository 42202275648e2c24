"""decode_attention / invariant_attention: kernels vs their PyTorch references (bitwise for the float64
numerics), decode == full sequence at the same position, GQA, padding rows, splits, cache views, errors;
GPU tests for the same on CUDA plus CUDA-graph replay."""
import pytest
import torch
import torch.nn.functional as F
from minite.kernels import attention as A

from minite.engines import attention as engine_attention
from minite.engines.decode_graphs import gc_paused


def _cache(slots, hkv, s, d, device="cpu", seed=0, layers=None):
    g = torch.Generator().manual_seed(seed)
    shape = (slots, hkv, s, d) if layers is None else (layers, slots, hkv, s, d)
    k = torch.randn(shape, generator=g).to(device, torch.bfloat16)
    v = torch.randn(shape, generator=g).to(device, torch.bfloat16)
    return k, v


def _q(b, hq, d, device="cpu", seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, d, generator=g) * scale).to(device, torch.bfloat16)


def _ids(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


# shapes: (hq, hkv, d, slots, s_max, slot_ids, seq_lens); slot 0 of the first case is a dummy padding row
DECODE_CASES = [
    (8, 2, 64, 5, 100, [4, 0, 2, 1], [37, 1, 100, 64]),      # GQA 4, len 1 and S_max, a 64-key boundary
    (6, 2, 128, 3, 130, [2, 0], [130, 65]),                    # GQA 3 (not a power of two), D 128
    (4, 4, 64, 2, 20, [1, 0], [20, 7]),                        # MHA
    (16, 1, 64, 2, 70, [1, 0], [70, 3]),                       # GQA 16
]


@pytest.mark.parametrize("hq,hkv,d,slots,s_max,slot_ids,seq_lens", DECODE_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_invariant_is_bitwise_the_reference(hq, hkv, d, slots, s_max, slot_ids, seq_lens, splits):
    kc, vc = _cache(slots, hkv, s_max, d)
    q, ids, lens = _q(len(slot_ids), hq, d), _ids(slot_ids), _ids(seq_lens)
    got = A.decode_attention(q, kc, vc, ids, lens, d ** -0.5, "invariant", splits=splits, backend="triton")
    want = A.decode_attention_reference(q, kc, vc, ids, lens, d ** -0.5, "invariant")
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("hq,hkv,d,slots,s_max,slot_ids,seq_lens", DECODE_CASES[:2] + DECODE_CASES[3:])
def test_decode_invariant_bits_do_not_depend_on_head_groups(hq, hkv, d, slots, s_max, slot_ids, seq_lens):
    kc, vc = _cache(slots, hkv, s_max, d)
    q, ids, lens = _q(len(slot_ids), hq, d), _ids(slot_ids), _ids(seq_lens)
    want = A.decode_attention_reference(q, kc, vc, ids, lens, d ** -0.5, "invariant")
    rep = hq // hkv
    for groups, splits in ((2, 1), (rep, 2), (3, 1)):  # GQA 3 in 2 groups: rows 2 + 1 (one masked)
        got = A.decode_attention(q, kc, vc, ids, lens, d ** -0.5, "invariant", splits=splits, backend="triton",
                                 head_groups=groups)
        assert torch.equal(got, want), (groups, splits)


def test_f64_head_groups_fill_two_programs_per_sm(monkeypatch):
    monkeypatch.setattr(A, "_sm_count", lambda device: 132)
    dev = torch.device("cpu")
    # (batch, KV heads, query heads per KV head) -> groups: Qwen3-30B-A3B at batch 64 / 8 / 128, the small model
    for shape, groups in (((64, 4, 8), 2), ((8, 4, 8), 8), ((128, 4, 8), 1), ((256, 4, 4), 1), ((1, 4, 3), 3)):
        assert A.f64_head_groups(*shape, dev) == groups, shape


@pytest.mark.parametrize("hq,hkv,d,slots,s_max,slot_ids,seq_lens", DECODE_CASES[:2] + DECODE_CASES[3:])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_fast_matches_sdpa(hq, hkv, d, slots, s_max, slot_ids, seq_lens, splits):
    kc, vc = _cache(slots, hkv, s_max, d, seed=2)
    q, ids, lens = _q(len(slot_ids), hq, d, seed=3), _ids(slot_ids), _ids(seq_lens)
    got = A.decode_attention(q, kc, vc, ids, lens, d ** -0.5, "fast", splits=splits, backend="triton")
    want = A.decode_attention_reference(q, kc, vc, ids, lens, d ** -0.5, "fast")
    exact = A.decode_attention_reference(q.double(), kc, vc, ids, lens, d ** -0.5, "invariant")
    assert (got.double() - exact).abs().max() < 2e-2  # bf16 P in the P.V dot, as flash attention
    assert (want.double() - exact).abs().max() < 2e-2


def test_decode_invariant_does_not_depend_on_splits_batch_or_cache_view():
    d, hq, hkv = 64, 8, 2
    cache5 = _cache(6, hkv, 90, d, layers=2, seed=4)
    kc, vc = cache5[0][1], cache5[1][1]                       # a layer view of [L, slots, Hkv, S, D]
    q, ids, lens = _q(4, hq, d, seed=5), _ids([5, 2, 3, 0]), _ids([90, 13, 64, 65])
    ref = A.decode_attention(q, kc.contiguous(), vc.contiguous(), ids, lens, 0.125, "invariant", splits=1,
                             backend="triton")
    for splits in (2, 4, 7):
        assert torch.equal(A.decode_attention(q, kc, vc, ids, lens, 0.125, "invariant", splits=splits,
                                              backend="triton"), ref)
    for i in range(4):  # one sequence alone == the same sequence inside the batch
        alone = A.decode_attention(q[i:i + 1], kc, vc, ids[i:i + 1], lens[i:i + 1], 0.125, "invariant",
                                   splits=2, backend="triton")
        assert torch.equal(alone, ref[i:i + 1])


@pytest.mark.parametrize("unroll,masked", [(1, False), (3, False), (16, False), (3, True), (8, True)])
def test_invariant_bits_do_not_depend_on_the_pv_rounds(unroll, masked, monkeypatch):
    """The p.v loop's rounds of keys (``F64_PV``) change which loads are in flight, not the sum: the
    references' bits for decode and full sequence at every round size, masked or not (lengths leave keys
    over)."""
    monkeypatch.setattr(A, "F64_PV", {"decode": (unroll, masked), "prefill": (unroll, masked)})
    kc, vc = _cache(3, 2, 100, 64, seed=6)
    q, ids, lens = _q(3, 8, 64, seed=7), _ids([2, 0, 1]), _ids([100, 37, 5])
    got = A.decode_attention(q, kc, vc, ids, lens, 0.125, "invariant", splits=2, backend="triton")
    assert torch.equal(got, A.decode_attention_reference(q, kc, vc, ids, lens, 0.125, "invariant"))
    g = torch.Generator().manual_seed(8)
    qs = torch.randn(1, 4, 70, 64, generator=g).bfloat16()
    k, v = torch.randn(1, 2, 70, 64, generator=g).bfloat16(), torch.randn(1, 2, 70, 64, generator=g).bfloat16()
    got = A.invariant_attention(qs, k, v, 0.125, backend="triton")
    assert torch.equal(got, A.invariant_attention_reference(qs, k, v, 0.125))


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d", [(2, 4, 2, 19, 19, 64), (1, 3, 1, 5, 12, 128), (2, 8, 2, 70, 70, 64)])
def test_full_sequence_is_bitwise_the_reference(b, hq, hkv, tq, tk, d):
    g = torch.Generator().manual_seed(tq)
    q = torch.randn(b, hq, tq, d, generator=g).bfloat16()
    k, v = torch.randn(b, hkv, tk, d, generator=g).bfloat16(), torch.randn(b, hkv, tk, d, generator=g).bfloat16()
    got = A.invariant_attention(q, k, v, d ** -0.5, backend="triton")
    assert torch.equal(got, A.invariant_attention_reference(q, k, v, d ** -0.5))
    assert got.shape == (b, tq, hq, d)


@pytest.mark.parametrize("causal", [True, False])
def test_full_sequence_with_keep_mask_and_empty_rows(causal):
    g = torch.Generator().manual_seed(9)
    b, h, t, d = 2, 4, 13, 64
    q = torch.randn(b, h, t, d, generator=g).bfloat16()
    k, v = torch.randn(b, h, t, d, generator=g).bfloat16(), torch.randn(b, h, t, d, generator=g).bfloat16()
    keep = torch.rand(b, 1, t, t, generator=g) > 0.3
    keep[0, 0, 3] = False  # a query that sees no key: zeros, as the reference
    got = A.invariant_attention(q, k, v, 0.125, keep=keep, causal=causal, backend="triton")
    want = A.invariant_attention_reference(q, k, v, 0.125, keep=keep, causal=causal)
    assert torch.equal(got, want) and not got[0, 3].any()


def test_decode_equals_full_sequence_at_every_position():
    """The property trainer == sampler log-probs rests on: the decode kernel at position p gives the bits of
    the full-sequence kernel's row p (and of the reference)."""
    g = torch.Generator().manual_seed(11)
    b, hq, hkv, t, d = 2, 8, 2, 70, 64
    q = torch.randn(b, hq, t, d, generator=g).bfloat16()
    k, v = torch.randn(b, hkv, t, d, generator=g).bfloat16(), torch.randn(b, hkv, t, d, generator=g).bfloat16()
    full = A.invariant_attention(q, k, v, d ** -0.5, backend="triton")
    kc, vc = _cache(3, hkv, 80, d, seed=12)  # rows 2 and 0 hold the sequences, row 1 is someone else
    kc[[2, 0], :, :t], vc[[2, 0], :, :t] = k, v
    ids = _ids([2, 0])
    for pos in (0, 1, 33, 63, 64, 69):
        step = A.decode_attention(q[:, :, pos], kc, vc, ids, _ids([pos + 1] * b), d ** -0.5, "invariant", splits=2,
                                  backend="triton")
        assert torch.equal(step, full[:, pos]), pos


def test_engine_functions_dispatch_and_hf_adapter():
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 9, 16, generator=g).bfloat16()
    k, v = torch.randn(1, 2, 9, 16, generator=g).bfloat16(), torch.randn(1, 2, 9, 16, generator=g).bfloat16()
    want = A.invariant_attention_reference(q, k, v, 0.25)
    assert torch.equal(engine_attention.invariant_attention(q, k, v, 0.25), want)
    causal_mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]

    class Module:
        is_causal = True
    with torch.no_grad():
        out, _ = engine_attention.hf_invariant_attention(Module(), q, k, v, causal_mask, scaling=0.25)
    assert torch.equal(out, want)
    kc, vc = _cache(2, 2, 9, 16, seed=14)
    ids, lens = _ids([1, 0]), _ids([9, 4])
    qd = _q(2, 4, 16, seed=15)
    assert torch.equal(engine_attention.decode_attention(qd, kc, vc, ids, lens, 0.25, invariant=True),
                       A.decode_attention_reference(qd, kc, vc, ids, lens, 0.25, "invariant"))


def test_bad_inputs():
    kc, vc = _cache(2, 2, 8, 16)
    q, ids, lens = _q(2, 4, 16), _ids([0, 1]), _ids([8, 3])
    with pytest.raises(ValueError, match="numerics"):
        A.decode_attention(q, kc, vc, ids, lens, 0.25, "fp8")
    with pytest.raises(ValueError, match="int32"):
        A.decode_attention(q, kc, vc, ids.long(), lens, 0.25)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        A.decode_attention(_q(2, 3, 16), kc, vc, ids, lens, 0.25)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        A.decode_attention(q, kc, vc, ids, _ids([9, 3]), 0.25)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        A.decode_attention(q, kc, vc, _ids([0, 2]), lens, 0.25)
    with pytest.raises(ValueError, match="splits"):
        A.decode_attention(q, kc, vc, ids, lens, 0.25, splits=65, backend="triton")
    for groups in (-1, 3):  # 2 query heads per KV head
        with pytest.raises(ValueError, match="head_groups"):
            A.decode_attention(q, kc, vc, ids, lens, 0.25, "invariant", head_groups=groups, backend="triton")
    with pytest.raises(ValueError, match="bool mask"):
        A.invariant_attention(q[:, :, None], kc[:, :, :4], vc[:, :, :4], 0.25, keep=torch.ones(1, 4, dtype=torch.int8))


def test_cuda_attention_config_rule():
    from minite.kernels import _cuda_attention as ca
    # (batch, KV heads, query heads per KV head, cache length) -> (splits, warps) on 132 SMs
    cases = {(64, 4, 8, 96): (1, 2), (64, 4, 8, 1024): (1, 4), (8, 4, 8, 96): (2, 4), (256, 4, 4, 288): (1, 2),
             (1, 4, 8, 96): (2, 4), (16, 4, 16, 64): (1, 4)}
    for shape, want in cases.items():
        assert ca.config(*shape, 132) == want, shape
    assert ca.config(8, 4, 8, 96, 132, splits=5) == (5, 2)  # a caller's splits stand


def test_cuda_attention_operands_and_availability(monkeypatch):
    from minite.kernels import _cuda_attention as ca
    q, (kc, vc) = _q(2, 8, 128), _cache(3, 1, 32, 128)
    assert ca.supports(q, kc, vc)
    assert not ca.supports(q.float(), kc, vc)                         # not BF16
    assert not ca.supports(_q(2, 8, 32), *_cache(3, 1, 32, 32))        # head dim not compiled
    wide = torch.zeros(3, 1, 32, 132, dtype=torch.bfloat16)[..., :128]
    assert not ca.supports(q, wide, vc)                                # positions 264 bytes apart
    shifted = torch.zeros(kc.numel() + 4, dtype=torch.bfloat16)[4:].view(kc.shape)
    assert not ca.supports(q, kc, shifted)                             # base not 16-byte aligned
    assert ca.module_for(torch.device("cpu")) is None
    ca.module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="float64 decode attention.*sm_80"):
            assert ca.module((7, 5)) is None
        monkeypatch.setenv("MINITE_KERNELS_CUDA", "0")
        assert ca.module((9, 0)) is None
    finally:
        ca.module.cache_clear()


# ------------------------------------------------------------------------------------------------ GPU
def _gpu_decode_case(b, hq, hkv, d, s_max, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    kc, vc = _cache(b + 1, hkv, s_max, d, dev, seed)
    q = _q(b, hq, d, dev, seed + 1)
    ids = torch.randperm(b + 1, generator=g)[:b].to(dev, torch.int32)
    lens = torch.randint(1, s_max + 1, (b,), generator=g)
    lens[0], lens[-1] = 1, s_max
    return q, kc, vc, ids, lens.to(dev, torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (16, 4, 128), (8, 8, 64), (16, 1, 64)])
def test_gpu_decode_vs_reference(hq, hkv, d):
    q, kc, vc, ids, lens = _gpu_decode_case(24, hq, hkv, d, 600)
    want = A.decode_attention_reference(q, kc, vc, ids, lens, d ** -0.5, "invariant")
    for splits, groups in ((None, None), (1, None), (5, None), (None, min(2, hq // hkv)), (1, hq // hkv)):
        got = A.decode_attention(q, kc, vc, ids, lens, d ** -0.5, "invariant", splits=splits, head_groups=groups)
        assert torch.equal(got, want), (splits, groups)
    fast = A.decode_attention(q, kc, vc, ids, lens, d ** -0.5, "fast")
    sdpa = A.decode_attention_reference(q, kc, vc, ids, lens, d ** -0.5, "fast")
    assert (fast.float() - sdpa.float()).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (24, 4, 128), (16, 4, 64), (8, 8, 64)])
def test_gpu_cuda_decode_attention_every_warp_count_and_split(hq, hkv, d):
    from minite.kernels import _cuda_attention as ca
    from minite.kernels import _triton_attention as ta
    mod = ca.module(torch.cuda.get_device_capability())
    assert mod is not None, "the CUDA fp64 decode attention did not build"
    q, kc, vc, ids, lens = _gpu_decode_case(24, hq, hkv, d, 600, seed=4)
    want = A.decode_attention_reference(q, kc, vc, ids, lens, d ** -0.5, "invariant")
    b = q.shape[0]
    for splits in (1, 3):
        for warps in (1, 2, 4, 8):
            out = torch.empty_like(q)
            pa = torch.empty(b * hq * splits * d, dtype=torch.float64, device=q.device)
            pm = torch.empty(b * hq * splits * 2, dtype=torch.float64, device=q.device)
            ca.launch(mod, q, kc, vc, ids, lens, pa, pm, out, d ** -0.5, splits, warps)
            if splits > 1:
                ta.merge_splits_kernel[(b, hq)](pa, pm, out, hq, splits, D=d, SPLITS_P2=4, F64=True)
            assert torch.equal(out, want), (splits, warps)
    assert torch.equal(A.decode_attention(q, kc, vc, ids, lens, d ** -0.5, "invariant", backend="triton"), want)


@pytest.mark.gpu
def test_gpu_decode_equals_full_sequence_and_batch_invariance():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(21)
    b, hq, hkv, t, d = 3, 32, 4, 300, 128
    q = torch.randn(b, hq, t, d, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(b, hkv, t, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(b, hkv, t, d, generator=g).to(dev, torch.bfloat16)
    full = A.invariant_attention(q, k, v, d ** -0.5)
    assert torch.equal(full, A.invariant_attention_reference(q, k, v, d ** -0.5))
    kc, vc = torch.zeros(b + 1, hkv, 512, d, device=dev, dtype=torch.bfloat16), \
        torch.zeros(b + 1, hkv, 512, d, device=dev, dtype=torch.bfloat16)
    kc[1:, :, :t], vc[1:, :, :t] = k, v
    ids = torch.arange(1, b + 1, device=dev, dtype=torch.int32)
    for pos in (0, 63, 64, 127, 299):
        lens = torch.full((b,), pos + 1, device=dev, dtype=torch.int32)
        step = A.decode_attention(q[:, :, pos], kc, vc, ids, lens, d ** -0.5, "invariant")
        assert torch.equal(step, full[:, pos]), pos
        alone = A.decode_attention(q[1:2, :, pos], kc, vc, ids[1:2], lens[1:2], d ** -0.5, "invariant")
        assert torch.equal(alone, step[1:2])


@pytest.mark.gpu
def test_gpu_full_sequence_with_hf_mask():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(22)
    b, hq, hkv, t, d = 4, 16, 4, 257, 128
    q = torch.randn(b, hq, t, d, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(b, hkv, t, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(b, hkv, t, d, generator=g).to(dev, torch.bfloat16)
    lens = torch.tensor([257, 100, 1, 200], device=dev)
    keep = (torch.arange(t, device=dev)[None, :] < lens[:, None])[:, None, None, :] \
        & torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    got = A.invariant_attention(q, k, v, d ** -0.5, keep=keep, causal=True)
    assert torch.equal(got, A.invariant_attention_reference(q, k, v, d ** -0.5, keep=keep, causal=True))


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["fast", "invariant"])
def test_gpu_decode_cuda_graph_replay_equals_eager(numerics):
    q, kc, vc, ids, lens = _gpu_decode_case(16, 32, 4, 128, 1024, seed=3)
    out = A.decode_attention(q, kc, vc, ids, lens, 128 ** -0.5, numerics, splits=4)  # warm up (compile)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out = A.decode_attention(q, kc, vc, ids, lens, 128 ** -0.5, numerics, splits=4)
    for seed in (5, 6):  # new queries, slots and lengths in the same buffers
        q2, _, _, ids2, lens2 = _gpu_decode_case(16, 32, 4, 128, 1024, seed=seed)
        q.copy_(q2)
        ids.copy_(ids2)
        lens.copy_(lens2)
        graph.replay()
        assert torch.equal(out, A.decode_attention(q, kc, vc, ids, lens, 128 ** -0.5, numerics, splits=4))


@pytest.mark.gpu
def test_gpu_fast_decode_matches_sdpa_on_the_valid_prefix():
    q, kc, vc, ids, lens = _gpu_decode_case(4, 32, 4, 128, 2048, seed=8)
    got = A.decode_attention(q, kc, vc, ids, lens, 128 ** -0.5, "fast")
    for i in range(4):
        n, s = int(lens[i]), int(ids[i])
        ref = F.scaled_dot_product_attention(q[i:i + 1, :, None], kc[s:s + 1, :, :n], vc[s:s + 1, :, :n],
                                             scale=128 ** -0.5, enable_gqa=True)[:, :, 0]
        assert (got[i:i + 1].float() - ref.float()).abs().max() < 2e-2
