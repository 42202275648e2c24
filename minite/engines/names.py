"""transformers' Qwen3-MoE parameter names -> the kind of module each belongs to, and its layer.

The one table every per-module decision reads: which modules the trainer swaps for NVFP4 ones, which
payload tensors travel as NVFP4 codes, which fused sampler weights are quantized, and so which weights
alignment compares. Kinds are what an arm's ``high_precision`` list and first/last-layer exceptions speak
of (``EngineRecipe.keeps_high_precision``):

    embed_tokens   the token embedding (never quantized)
    norm           RMSNorm weights (never quantized)
    attention      q/k/v/o projections
    router         the MoE router (``mlp.gate``)
    experts        the stacked expert weights (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    mlp            a dense MLP layer's projections (layers without experts)
    lm_head        the output projection
"""
from __future__ import annotations

import re

#: parameter name (layer index as ``{i}``) -> kind
KINDS: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "norm",
    "model.layers.{i}.post_attention_layernorm.weight": "norm",
    "model.layers.{i}.self_attn.q_norm.weight": "norm",
    "model.layers.{i}.self_attn.k_norm.weight": "norm",
    "model.layers.{i}.self_attn.q_proj.weight": "attention",
    "model.layers.{i}.self_attn.k_proj.weight": "attention",
    "model.layers.{i}.self_attn.v_proj.weight": "attention",
    "model.layers.{i}.self_attn.o_proj.weight": "attention",
    "model.layers.{i}.mlp.gate.weight": "router",
    "model.layers.{i}.mlp.experts.gate_up_proj": "experts",
    "model.layers.{i}.mlp.experts.down_proj": "experts",
    "model.layers.{i}.mlp.gate_proj.weight": "mlp",
    "model.layers.{i}.mlp.up_proj.weight": "mlp",
    "model.layers.{i}.mlp.down_proj.weight": "mlp",
}
#: kinds an NVFP4 engine quantizes unless its recipe keeps them in high precision
QUANTIZABLE = frozenset({"attention", "router", "experts", "mlp", "lm_head"})

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def param_kind(name: str) -> tuple[str | None, int | None]:
    """(kind, layer index) of a parameter name; layer None outside the decoder layers, kind None for a name
    the table does not know (such a parameter is never quantized)."""
    m = _LAYER.match(name)
    if m is None:
        return KINDS.get(name), None
    return KINDS.get("model.layers.{i}." + name[m.end():]), int(m.group(1))


def is_quantized(recipe, name: str, num_layers: int) -> bool:
    """Whether an engine running ``recipe`` (an ``EngineRecipe``) holds parameter ``name`` as NVFP4."""
    kind, layer = param_kind(name)
    return kind in QUANTIZABLE and not recipe.keeps_high_precision(kind, layer, num_layers)
