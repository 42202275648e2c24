"""The trainer's NVFP4 autograd through the fused quantizer kernels (the Triton interpreter here, the GPU's
default backend) gives bitwise the same forward outputs and gradients as through the PyTorch reference:
weights (16x16, per-shard amax), activations, the dgrad operand, and the wgrad operands read as padded /
gathered transposed views with RHT + stochastic rounding."""
from __future__ import annotations

import functools

import pytest
import torch

from minite.engines import quant_linear as Q
from minite.engines.arms import load_arm


def _bits(t):
    return t.contiguous().view(torch.int16)


def _linear_and_experts(trainer_recipe, backward_gemm: str | None = None):
    """Forward and backward of an NVFP4Linear and the tiny model's experts; ``backward_gemm`` switches the
    GEMM path between forward and backward (same forward, another backward)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from minite.engines import experts as X
    from minite.engines.models import build_hf_config, load_model_config

    torch.manual_seed(1)
    st = Q.QuantState(trainer_recipe, cache_per_update=False, seed=0)
    w = torch.nn.Parameter((torch.randn(64, 128) * 0.05).bfloat16())
    x = torch.randn(2, 37, 128).bfloat16().requires_grad_()        # 74 tokens: the wgrad pads them to 80
    y = Q.NVFP4Linear(w, st)(x)
    st.gemm = backward_gemm or st.gemm
    y.backward(torch.randn(2, 37, 64).bfloat16())
    out = [y.detach(), x.grad, w.grad]
    hc = build_hf_config(load_model_config("tiny"), experts_implementation=X.register_experts())
    mod = Qwen3MoeExperts(hc).to(torch.bfloat16)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.05)
        mod.down_proj.normal_(0, 0.05)
    xe = torch.randn(39, 128).bfloat16().requires_grad_()             # 78 routed rows: not whole blocks of 16
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(39)])
    idx[idx == 5] = 6                                                # expert 5 gets no tokens
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 5, idx[:, 1])
    mod.minite_quant = X.ExpertsQuant(Q.QuantState(trainer_recipe, False, seed=0))
    o = mod(xe, idx, torch.softmax(torch.randn(39, 2), -1).bfloat16())
    mod.minite_quant.state.gemm = backward_gemm or mod.minite_quant.state.gemm
    o.backward(torch.randn(39, 128).bfloat16())
    return out + [o.detach(), xe.grad, mod.gate_up_proj.grad, mod.down_proj.grad]


@pytest.mark.parametrize("arm", ["naive_te_nvfp4", "minite_nvfp4"])
def test_trainer_through_the_kernels_is_bitwise_the_reference(arm, monkeypatch):
    recipe = load_arm(arm).trainer
    assert recipe.backward_rht and recipe.backward_rounding == "stochastic"
    from minite import kernels
    for name in ("nvfp4_gemm", "grouped_nvfp4_gemm", "wgrad_grouped_nvfp4_gemm"):  # the W4A4 GEMMs: exact CPU path
        monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), backend="torch"))
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "torch")
    want = _linear_and_experts(recipe)
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")
    got = _linear_and_experts(recipe)
    names = ["y", "dx", "dW", "experts out", "experts dx", "dgate_up", "ddown"]
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b)), name


@pytest.mark.parametrize("interpreted", [False, True])
def test_wgrad_layout_pads_segments_and_gives_empty_experts_zero_blocks(interpreted):
    from minite.kernels._backend import interpreter_on

    from minite.engines.experts import _padded_layout
    if interpreted and not interpreter_on():
        pytest.skip("the Triton layout kernel on CPU needs the interpreter")
    offsets = torch.tensor([0, 3, 3, 20, 35], dtype=torch.int32)     # expert 1 empty, 35 rows in all
    src, pends = _padded_layout(offsets, 35, interpreted=interpreted)
    assert pends.tolist() == [16, 32, 64, 48 + 16 * 4]                 # the static width's slack joins the last
    want = torch.full((48 + 64,), -1, dtype=torch.int32)
    want[0:3] = torch.arange(0, 3)
    want[32:49] = torch.arange(3, 20)
    want[64:79] = torch.arange(20, 35)
    assert torch.equal(src, want)


LAYOUTS = [(16, True), (16, False), (128, False), (32, True)]


def _layout_kernel_vs_torch(align, fill, dev):
    from minite.engines.experts import _padded_layout, _padded_layout_torch
    g = torch.Generator().manual_seed(align)
    for e in (1, 7, 128):
        counts = torch.randint(0, 70, (e,), generator=g) * (torch.rand(e, generator=g) > 0.3)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(dev)
        rows = int(offs[-1])
        got = _padded_layout(offs, rows, align, fill, interpreted=True)
        want = _padded_layout_torch(offs, rows, align, fill)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (e, align, fill)


@pytest.mark.parametrize("align, fill", LAYOUTS)
def test_wgrad_layout_kernel_equals_its_torch_formula(align, fill):
    from minite.kernels._backend import interpreter_on
    if not interpreter_on():
        pytest.skip("the Triton layout kernel on CPU needs the interpreter")
    _layout_kernel_vs_torch(align, fill, "cpu")


@pytest.mark.parametrize("arm", ["naive_te_nvfp4", "minite_nvfp4"])
def test_an_expert_without_tokens_gets_exactly_zero_gradient(arm):
    grads = _linear_and_experts(load_arm(arm).trainer)
    dgate_up, ddown = grads[-2], grads[-1]
    for g in (dgate_up, ddown):
        assert torch.equal(_bits(g[5]), torch.zeros_like(_bits(g[5])))  # +0 everywhere, no -0 or noise
        assert g[[e for e in range(g.shape[0]) if e != 5]].abs().amax(dim=(1, 2)).gt(0).sum() >= 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arm", ["naive_te_nvfp4", "minite_nvfp4"])
def test_gpu_nvfp4_modules_forward_backward_never_wait_for_the_host(arm):
    """The NVFP4 linear and experts (forward, then backward) queue their work without one host sync, so
    the GPU never idles while Python catches up (CUDA's sync debug mode raises on any)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from minite.engines import experts as X
    from minite.engines.models import build_hf_config, load_model_config

    dev = torch.device("cuda")
    recipe = load_arm(arm).trainer
    st = Q.QuantState(recipe, cache_per_update=True, seed=0)
    st.cuda = True
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(hc_hidden := 1024, 512, device=dev) * 0.05).bfloat16())
    lin = Q.NVFP4Linear(w, st)
    hc = build_hf_config(load_model_config("small"), experts_implementation=X.register_experts())
    assert hc.hidden_size == hc_hidden
    mod = Qwen3MoeExperts(hc).to(dev, torch.bfloat16)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.05)
        mod.down_proj.normal_(0, 0.05)
    mod.minite_quant = X.ExpertsQuant(st)
    x = torch.randn(299, 512, device=dev).bfloat16().requires_grad_()   # 1,196 routed rows
    idx = torch.randint(0, hc.num_experts, (299, hc.num_experts_per_tok), device=dev)
    rw = torch.softmax(torch.randn(299, hc.num_experts_per_tok, device=dev), -1).bfloat16()
    # the first pass compiles the kernels and fills the weight caches (a weight's NaN check is a host read,
    # once per update); the second must not read anything back
    for sync_mode in ("default", "error"):
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            mod(lin(x), idx, rw).float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(mod.down_proj.grad.float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arm", ["bf16", "naive_te_nvfp4", "minite_nvfp4"])
def test_gpu_trainer_micro_batch_never_waits_for_the_host(arm):
    """A learner micro-batch (the trainer's forward, loss and backward), padded or not, queues its work without
    one host sync (CUDA's sync debug mode raises on any): no mask creation that reads position ids back."""
    from minite.engines.trainer import Trainer

    tr = Trainer(arm, "tiny", device="cuda", seed=0, weight_cache="per_update")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (2, 48), generator=g).cuda()
    am = torch.ones_like(ids)
    am[1, 40:] = 0
    for mask in (None, am):
        # the first pass compiles the kernels and fills the weight caches (a weight's NaN check reads back)
        for sync_mode in ("default", "error"):
            torch.cuda.set_sync_debug_mode(sync_mode)
            try:
                lp = tr._token_logprobs(ids, mask)
                (lp * am[:, 1:]).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad.float()).all() for p in tr.model.parameters() if p.grad is not None)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _grouped_op(recipe, shards: int, backward_gemm: str | None = None):
    """One experts GEMM (gate_up: 2 shards with their own scales; down: 1) forward + backward on 78 sorted rows
    over 8 experts, expert 5 without rows: (y, dx, dW)."""
    from minite.engines import experts as X
    torch.manual_seed(2)
    st = Q.QuantState(recipe, cache_per_update=False, seed=0)
    n, k = (256, 128) if shards == 2 else (128, 128)
    w = torch.nn.Parameter((torch.randn(8, n, k) * 0.05).bfloat16())
    x = torch.randn(78, k).bfloat16().requires_grad_()
    offsets = torch.tensor([0, 9, 20, 21, 40, 52, 52, 70, 78], dtype=torch.int32)
    y = X._GroupedNVFP4Fn.apply(x, w, Q.WeightCache(st, recipe.weights, shards).get(w), offsets, st)
    st.gemm = backward_gemm or st.gemm
    y.backward(torch.randn(78, n).bfloat16())
    return [y.detach(), x.grad, w.grad]


def test_kernel_backward_runs_on_nvfp4_operands_and_agrees_with_the_emulated_one(monkeypatch):
    """gemm "kernel": dgrad and wgrad (dense and experts) run the NVFP4 GEMMs on the codes (exact products,
    here the exact CPU path); gemm "emulated" multiplies the BF16 dequantized values. Same forward, same
    quantized operands (RNE, no RHT: identical codes in both wgrad layouts), so per op the two differ only by
    the BF16 rounding of the emulated operands."""
    from minite import kernels
    calls = []
    for name in ("nvfp4_gemm", "grouped_nvfp4_gemm", "wgrad_grouped_nvfp4_gemm"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=fn, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    rec = load_arm("minite_nvfp4").override({"trainer.backward": {"rounding": "nearest", "rht": False}}).trainer
    native = _linear_and_experts(rec)
    assert calls.count("wgrad_grouped_nvfp4_gemm") == 2 and calls.count("grouped_nvfp4_gemm") == 4
    assert calls.count("nvfp4_gemm") == 3                      # forward, dgrad, wgrad of the linear
    calls.clear()
    emulated = _linear_and_experts(rec, backward_gemm="emulated")
    assert calls == ["nvfp4_gemm", "grouped_nvfp4_gemm", "grouped_nvfp4_gemm"]  # the forwards only
    for name, a, b in zip(["y", "dx", "dW", "experts out"], native[:4], emulated[:4], strict=True):
        assert _rel(a, b) < 1e-2, name                     # chained experts grads: re-quantized, not compared
    for shards in (2, 1):
        for name, a, b in zip(("y", "dx", "dW"), _grouped_op(rec, shards), _grouped_op(rec, shards, "emulated"),
                                 strict=True):
            assert _rel(a, b) < 1e-2, (shards, name)
    # the default recipe (SR + RHT): a dense layer's operands are drawn in the same layout on both paths (the
    # same codes: BF16 rounding apart); the experts' wgrad segments are laid out differently (128 vs 16
    # tokens), so their SR draws differ: the same size, no closer
    rec = load_arm("minite_nvfp4").trainer
    for name, a, b in zip(["y", "dx", "dW"], _linear_and_experts(rec)[:3], _linear_and_experts(rec, "emulated")[:3],
                          strict=True):
        assert _rel(a, b) < 1e-2, name
    for name, a, b in zip(("y", "dx", "dW"), _grouped_op(rec, 2), _grouped_op(rec, 2, "emulated"), strict=True):
        assert torch.isfinite(a).all() and _rel(a, b) < (1e-2 if name != "dW" else 0.3), name
