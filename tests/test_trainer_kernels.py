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


def _linear_and_experts(trainer_recipe):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from minite.engines import experts as X
    from minite.engines.models import build_hf_config, load_model_config

    torch.manual_seed(1)
    st = Q.QuantState(trainer_recipe, cache_per_update=False, seed=0)
    w = torch.nn.Parameter((torch.randn(64, 128) * 0.05).bfloat16())
    x = torch.randn(2, 37, 128).bfloat16().requires_grad_()        # 74 tokens: the wgrad pads them to 80
    y = Q.NVFP4Linear(w, st)(x)
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
    o.backward(torch.randn(39, 128).bfloat16())
    return out + [o.detach(), xe.grad, mod.gate_up_proj.grad, mod.down_proj.grad]


@pytest.mark.parametrize("arm", ["naive_te_nvfp4", "minite_nvfp4"])
def test_trainer_through_the_kernels_is_bitwise_the_reference(arm, monkeypatch):
    recipe = load_arm(arm).trainer
    assert recipe.backward_rht and recipe.backward_rounding == "stochastic"
    from minite import kernels
    for name in ("nvfp4_gemm", "grouped_nvfp4_gemm"):  # the W4A4 GEMMs stay on their exact CPU path
        monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), backend="torch"))
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "torch")
    want = _linear_and_experts(recipe)
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")
    got = _linear_and_experts(recipe)
    names = ["y", "dx", "dW", "experts out", "experts dx", "dgate_up", "ddown"]
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b)), name


def test_wgrad_layout_pads_segments_and_gives_empty_experts_zero_blocks():
    from minite.engines.experts import _padded_layout
    offsets = torch.tensor([0, 3, 3, 20, 35], dtype=torch.int32)     # expert 1 empty, 35 rows in all
    src, pends = _padded_layout(offsets, 35)
    assert pends.tolist() == [16, 32, 64, 48 + 16 * 4]                 # the static width's slack joins the last
    want = torch.full((48 + 64,), -1, dtype=torch.int32)
    want[0:3] = torch.arange(0, 3)
    want[32:49] = torch.arange(3, 20)
    want[64:79] = torch.arange(20, 35)
    assert torch.equal(src, want)


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
