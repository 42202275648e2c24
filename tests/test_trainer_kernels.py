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
    xe = torch.randn(40, 128).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    idx[idx == 5] = 6                                                # expert 5 gets no tokens
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 5, idx[:, 1])
    mod.minite_quant = X.ExpertsQuant(Q.QuantState(trainer_recipe, False, seed=0))
    o = mod(xe, idx, torch.softmax(torch.randn(40, 2), -1).bfloat16())
    o.backward(torch.randn(40, 128).bfloat16())
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
