"""Weight sync trainer -> sampler: the payload.

Payload (``trainer.export_weights()``, docs/ENGINES.md): ``{"form": "bf16" | "nvfp4_codes", "tensors":
{hf_param_name: tensor | NVFP4Tensor | list[NVFP4Tensor]}}`` keyed by transformers' Qwen3-MoE parameter names;
``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] are one stacked tensor
(BF16) or a list of E NVFP4Tensors (codes form). The sampler turns it into its fused weights
(``minite.engines.sampler_weights``).
``payload_from_hf_model(model, arm)`` builds a payload from a transformers ``Qwen3MoeForCausalLM`` the way
the trainer ships it (BF16 state dict, or codes quantized with ``arm.trainer.weights``), for tests and for the
trainer to reuse.
"""
from __future__ import annotations

import torch

from minite import nvfp4
from minite.engines.arms import Arm, QuantSpec
from minite.engines.names import is_quantized, param_kind
from minite.engines.sampler_weights import FORMS, quantize_experts, quantize_weight

__all__ = ["FORMS", "payload_bytes", "payload_from_hf_model", "sync_weights"]


# ------------------------------------------------------------------------------------------------ payloads
def _trainer_spec(arm: Arm) -> QuantSpec:
    spec = arm.trainer.weights
    if not isinstance(spec, QuantSpec):
        raise ValueError(f"arm {arm.name}: codes sync needs a trainer weights spec")
    return spec


@torch.no_grad()
def payload_from_hf_model(model, arm: Arm) -> dict:
    """A sync payload from a transformers Qwen3MoeForCausalLM, as the trainer ships it under ``arm.sync``:
    "bf16" = the BF16 state dict; "nvfp4_codes" = every linear the trainer quantizes as NVFP4 codes made with
    ``arm.trainer.weights`` from the BF16 weights (each of q/k/v its own global scale; gate/up per expert
    quantized per shard -> per-row global scale [2I]), everything else BF16."""
    sd = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    if arm.sync == "bf16":
        return {"form": "bf16", "tensors": sd}
    n = model.config.num_hidden_layers
    spec = _trainer_spec(arm)
    out = {}
    for name, v in sd.items():
        if is_quantized(arm.trainer, name, n):
            if param_kind(name)[0] == "experts":  # gate_up_proj: two shards, gate and up
                v = quantize_experts(v, spec, shards=2 if name.endswith(".gate_up_proj") else 1)
            else:
                v = quantize_weight([v], spec)
        out[name] = v
    return {"form": "nvfp4_codes", "tensors": out}


def sync_weights(trainer, sampler) -> dict:
    """Ship the trainer's weights to the sampler (``trainer.export_weights()`` -> ``sampler.load_weights``).
    Returns a small summary (form, tensors, bytes; from a sharded trainer also its buckets and the bytes it
    all-gathered) for logs."""
    payload = trainer.export_weights()
    if payload.get("form") != ("nvfp4_codes" if sampler.arm.sync == "nvfp4_codes" else "bf16"):
        raise ValueError(f"arm {sampler.arm.name} syncs {sampler.arm.sync!r} but the trainer exported "
                         f"{payload.get('form')!r}")
    sampler.load_weights(payload)
    out = {"form": payload["form"], "tensors": len(payload["tensors"]), "bytes": payload_bytes(payload)}
    gathered = getattr(trainer, "last_export", None)    # a sharded trainer: its buckets and bytes all-gathered
    return {**out, "buckets": gathered["buckets"], "gather_bytes": gathered["gathered_bytes"]} if gathered else out


def payload_bytes(payload: dict) -> int:
    def size(v):
        if isinstance(v, nvfp4.NVFP4Tensor):
            return sum(x.numel() * x.element_size() for x in (v.codes, v.scales, v.global_scale))
        if isinstance(v, (list, tuple)):
            return sum(size(x) for x in v)
        return v.numel() * v.element_size()
    return sum(size(v) for v in payload["tensors"].values())
