"""route: the fused routing kernel (the interpreter here) is bitwise its PyTorch emulation of torch's CUDA
orders, for both top-k sum trees; the emulation picks torch's experts and sorts as a bitonic network must;
on the GPU the kernel is bitwise torch's own ops (the trainer's router), probe and all, on rows full of
ties, and replays in a CUDA graph."""
import pytest
import torch
from minite.kernels import routing as R

from minite.engines.decode_graphs import gc_paused


def _logits(t, e, kind, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # coarse values: many equal probabilities at and around the k-th largest
        x = torch.randint(-4, 5, (t, e), generator=g).float() * 0.5
    else:
        x = torch.randn(t, e, generator=g).bfloat16().float() * 2
    return x.to(device)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("e,k,kind,tree,norm,out", [
    (128, 8, "ties", "halves", True, torch.bfloat16),
    (128, 8, "bf16", "pairs", True, torch.float32),
    (60, 6, "ties", "pairs", True, torch.bfloat16),
    (8, 2, "bf16", "halves", False, torch.bfloat16),
    (40, 32, "ties", "halves", True, torch.float16),
    (16, 16, "ties", "pairs", False, torch.float32),
])
def test_kernel_is_its_emulation(e, k, kind, tree, norm, out):
    x = _logits(21, e, kind, seed=e + k)
    want = R.route_emulated(x, k, norm, "hf", out, tree=tree)
    got = R.route_fused(x, k, norm, out, tree)
    assert _same(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].dtype == torch.int64 and got[0].shape == (21, k)


def test_bf16_logits_are_read_as_their_values():
    x = _logits(9, 32, "bf16", seed=3)
    a = R.route_fused(x.bfloat16(), 4, True, torch.bfloat16, "halves")
    b = R.route_fused(x, 4, True, torch.bfloat16, "halves")
    assert _same(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("norm,mode,out", [(True, "hf", torch.bfloat16), (False, "vllm", None)])
def test_route_parts_is_the_sum_pass_then_route(norm, mode, out):
    from minite.kernels import hp_gemm

    g = torch.Generator().manual_seed(11)
    x = torch.randn(13, 2048, generator=g).bfloat16()
    w = (torch.randn(128, 2048, generator=g) * 0.02).bfloat16()
    parts = hp_gemm.invariant_gemm_parts(x, w, backend="triton")
    logits = hp_gemm.sum_parts(parts, x.dtype, torch.float32)
    want = R.route_fused(logits, 8, norm, out or torch.float32, "halves")
    got = R.route_parts(parts, x.dtype, 8, norm, mode, out, backend="triton")
    assert _same(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = R.route_parts(parts, x.dtype, 8, norm, mode, out)  # CPU auto: the sum, then torch's ops
    rref = R.route_reference(logits, 8, norm, mode, out)
    assert _same(ref[0], rref[0]) and torch.equal(ref[1], rref[1])
    with pytest.raises(ValueError, match="partial sums"):
        R.route_parts(logits, x.dtype, 8, norm, mode, out)


def test_emulation_picks_torchs_experts_and_sorts_them():
    x = torch.randn(200, 128, generator=torch.Generator().manual_seed(0)) * 3  # fp32: no ties
    w, ids = R.route_emulated(x, 8, False, "vllm")
    _, ref_ids = torch.topk(torch.softmax(x, -1), 8, dim=-1)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, torch.softmax(x, -1).gather(-1, ids), rtol=1e-6, atol=0)
    t = _logits(50, 128, "ties", seed=1)
    w, ids = R.route_emulated(t, 8, False, "vllm")
    assert bool((w[:, :-1] >= w[:, 1:]).all())                            # descending
    p = torch.softmax(t, -1)
    assert torch.allclose(p.gather(-1, ids), w, rtol=1e-6, atol=0)       # each weight is its expert's
    assert torch.allclose(p.topk(8, -1).values, w, rtol=1e-6, atol=0)    # the k largest values
    assert all(len(set(r.tolist())) == 8 for r in ids)


def test_bitonic_network_is_torchs_32_slot_network():
    stages = R.bitonic_stages()
    assert len(stages) == 15 and stages[:3] == [(1, 2), (2, 4), (1, 4)] and stages[-5:] == [
        (16, 0), (8, 0), (4, 0), (2, 0), (1, 0)]


def test_bad_input_and_fallbacks():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError):
        R.route(x, 17, True, "hf")
    with pytest.raises(ValueError):
        R.route(x, 4, True, "fast")
    with pytest.raises(ValueError):
        R.route(x[0], 4, True, "hf")
    with pytest.raises(ValueError):
        R.route_emulated(x, 4, True, "hf", tree="sideways")
    w, ids = R.route(x, 4, True, "hf")                                     # CPU: torch's ops
    rw, rids = R.route_reference(x, 4, True, "hf")
    assert _same(w, rw) and torch.equal(ids, rids)
    assert not R.fused_fits(torch.randn(2, 2048), 8, torch.float32)       # another softmax kernel
    assert not R.fused_fits(x, 33, torch.float32)                         # another sort


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(128, 8), (60, 6), (16, 4)])
def test_gpu_fused_route_is_torchs_ops_bitwise(e, k):
    from minite.kernels import _probe

    for mode, dtype, in_dtype in (("hf", torch.bfloat16, torch.float32), ("vllm", None, torch.bfloat16)):
        for kind, seed in (("ties", 0), ("bf16", 1), ("ties", 2)):
            x = _logits(3000, e, kind, seed, "cuda").to(in_dtype)
            want = R.route_reference(x, k, True, mode, dtype)
            got = R.route(x, k, True, mode, dtype)
            assert _same(got[0], want[0]) and torch.equal(got[1], want[1])
            for rows in (1, 7, 64):  # any row count: each row's own bits
                part = R.route(x[:rows], k, True, mode, dtype)
                assert _same(part[0], want[0][:rows]) and torch.equal(part[1], want[1][:rows])
    verdicts = _probe.verdicts("('route'")
    assert any(v for key, v in verdicts.items() if key[2] == e and key[3] == k), verdicts  # the kernel ran


@pytest.mark.gpu
def test_gpu_route_parts_is_the_router_then_route():
    from minite.kernels import hp_gemm

    g = torch.Generator().manual_seed(12)
    w = (torch.randn(128, 2048, generator=g) * 0.02).bfloat16().cuda()
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 2048, generator=g).bfloat16().cuda()
        logits = hp_gemm.invariant_gemm(x, w, out_dtype=torch.float32)
        parts = hp_gemm.invariant_gemm_parts(x, w)
        assert parts is not None and torch.equal(hp_gemm.sum_parts(parts, x.dtype, torch.float32), logits)
        for mode, dtype in (("hf", torch.bfloat16), ("vllm", None)):
            want = R.route_reference(logits, 8, True, mode, dtype)
            got = R.route_parts(parts, x.dtype, 8, True, mode, dtype)
            assert _same(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_route_replays_in_a_graph():
    x = _logits(64, 128, "ties", 5, "cuda")
    want = R.route(x, 8, True, "hf", torch.bfloat16)  # probed and compiled before the capture
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        got = R.route(x, 8, True, "hf", torch.bfloat16)
    x.copy_(_logits(64, 128, "bf16", 6, "cuda"))
    g.replay()
    ref = R.route_reference(x, 8, True, "hf", torch.bfloat16)
    assert _same(got[0], ref[0]) and torch.equal(got[1], ref[1]) and not torch.equal(want[1], got[1])
