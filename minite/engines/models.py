"""Model configs (configs/models/*.yaml) -> transformers' Qwen3MoeConfig / Qwen3MoeForCausalLM.

A model YAML uses upstream ``Qwen3MoeConfig`` field names (schema: configs/schemas/model.schema.yaml) plus
``tokenizer`` (``char`` or a local HF tokenizer dir) and ``checkpoint`` (``null`` = random init, else a
local HF checkpoint dir; nothing is ever downloaded). ``num_layers`` slices the depth at full width.

Every GEMM dimension must be a multiple of 16 (NVFP4 blocks are 16 wide along K; weight tiles are 16x16):
``check_gemm_dims`` raises ``ModelConfigError`` otherwise. The router's N (= num_experts) and the lm_head's N
(the vocabulary) are exempt: an arm that quantizes the router uses 1x16 weight blocks when N % 16 != 0; the
lm_head then stays BF16.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from minite.yamlconfig import load_yaml, validate

MODELS = ("tiny", "small", "moe64", "qwen3_30b_a3b")  # the shipped models
_NOT_HF = ("name", "description", "tokenizer", "checkpoint", "rope_theta")


class ModelConfigError(ValueError):
    """A malformed, unknown or unsupported model config."""


def _validate(raw: dict, source: str) -> dict:
    validate(raw, "model", source, ModelConfigError)
    check_gemm_dims(raw, source)
    return raw


def gemm_dims(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of every linear in one decoder layer, plus the lm_head."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    i = cfg["moe_intermediate_size"]
    return {
        "q_proj": (cfg["num_attention_heads"] * d, h), "k_proj": (cfg["num_key_value_heads"] * d, h),
        "v_proj": (cfg["num_key_value_heads"] * d, h), "o_proj": (h, cfg["num_attention_heads"] * d),
        "experts.gate_up_proj": (2 * i, h), "experts.down_proj": (h, i), "router": (cfg["num_experts"], h),
        "lm_head": (cfg["vocab_size"], h),
    }


def check_gemm_dims(cfg: dict, source: str = "<dict>") -> None:
    bad = []
    for name, (n, k) in gemm_dims(cfg).items():
        if k % 16:
            bad.append(f"{name} K={k}")
        if n % 16 and name not in ("router", "lm_head"):  # router: 1x16 fallback; lm_head stays BF16
            bad.append(f"{name} N={n}")
    if bad:
        raise ModelConfigError(f"model {source}: NVFP4 needs every GEMM's K and N to be multiples of 16: "
                               + ", ".join(bad))
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ModelConfigError(f"model {source}: num_attention_heads ({cfg['num_attention_heads']}) is not a "
                               f"multiple of num_key_value_heads ({cfg['num_key_value_heads']})")
    if cfg["num_experts_per_tok"] > cfg["num_experts"]:
        raise ModelConfigError(f"model {source}: num_experts_per_tok ({cfg['num_experts_per_tok']}) > num_experts "
                               f"({cfg['num_experts']})")


def check_positions(model_cfg: dict, width: int, what: str) -> None:
    """Refuse, before any engine is built, sequences longer than the model's positions (RoPE past them is
    silently out of distribution, not an error). ``what`` names the config keys that make ``width``."""
    limit = int(model_cfg["max_position_embeddings"])
    if width > limit:
        raise ModelConfigError(f"{what} = {width} tokens > model {model_cfg.get('name')}'s max_position_embeddings "
                               f"{limit}: lower them or use a model with more positions")


def load_model_config(name_or_path: str | Path | dict, num_layers: int | None = None) -> dict:
    """configs/models/<name>.yaml, a YAML path, or an already-loaded dict -> validated dict (a copy)."""
    if isinstance(name_or_path, dict):
        raw, source = copy.deepcopy(name_or_path), name_or_path.get("name", "<dict>")
    else:
        raw, source = load_yaml("model", name_or_path, ModelConfigError)
    raw.setdefault("checkpoint", None)
    _validate(raw, source)
    if num_layers is not None:
        if not 1 <= int(num_layers) <= raw["num_hidden_layers"]:
            raise ModelConfigError(f"model {raw['name']}: num_layers={num_layers} outside "
                                   f"1..{raw['num_hidden_layers']}")
        raw["num_hidden_layers"] = int(num_layers)
    return raw


def build_hf_config(model_cfg: dict, attn_implementation: str | None = None,
                    experts_implementation: str | None = None):
    """The upstream ``transformers.Qwen3MoeConfig`` for a validated model dict."""
    from transformers import Qwen3MoeConfig

    kw = {k: v for k, v in model_cfg.items() if k not in _NOT_HF}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(model_cfg["rope_theta"])}
    kw.setdefault("intermediate_size", 4 * model_cfg["hidden_size"])
    kw.update(use_cache=False, output_router_logits=False, attention_bias=False, decoder_sparse_step=1,
              mlp_only_layers=[])
    if model_cfg.get("tokenizer") == "char":
        from minite.tokenizer import BOS, EOS, PAD
        kw.update(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    return Qwen3MoeConfig(**kw)


def build_hf_model(model_cfg: dict, hf_config, seed: int = 0, checkpoint: str | None = None,
                   dtype=None, device="cpu"):
    """Random-init (seeded, created directly in ``dtype`` on ``device``; default BF16) or local-checkpoint
    ``Qwen3MoeForCausalLM``. A checkpoint loads on CPU; the caller moves the model."""
    import torch  # here, not at the top: loading a model config (the pipeline checks them) needs no torch
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype

    ckpt = checkpoint if checkpoint is not None else model_cfg.get("checkpoint")
    if ckpt:
        ckpt = Path(ckpt)
        if not (ckpt / "config.json").is_file():
            raise ModelConfigError(f"checkpoint {ckpt}: not a local HF checkpoint dir (no config.json); "
                                   "minite never downloads weights")
        disk = json.loads((ckpt / "config.json").read_text())
        for key in ("hidden_size", "num_experts", "moe_intermediate_size", "num_attention_heads", "vocab_size"):
            if key in disk and disk[key] != model_cfg[key]:
                raise ModelConfigError(f"checkpoint {ckpt}: {key}={disk[key]} but model config says "
                                       f"{model_cfg[key]}")
        # num_hidden_layers in hf_config may be smaller: the layers beyond it are skipped (a depth slice)
        return Qwen3MoeForCausalLM.from_pretrained(str(ckpt), config=hf_config, dtype=dtype,
                                                   local_files_only=True)
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), dev:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if type(model) is not Qwen3MoeForCausalLM:
        raise ModelConfigError(f"expected Qwen3MoeForCausalLM, transformers built {type(model).__name__}")
    return model


def count_params(model_cfg: dict) -> dict[str, int]:
    """Total and per-token-active parameter counts (for docs and sanity checks)."""
    h, L, v = model_cfg["hidden_size"], model_cfg["num_hidden_layers"], model_cfg["vocab_size"]
    d, e, k = model_cfg["head_dim"], model_cfg["num_experts"], model_cfg["num_experts_per_tok"]
    i = model_cfg["moe_intermediate_size"]
    attn = h * d * (2 * model_cfg["num_attention_heads"] + 2 * model_cfg["num_key_value_heads"])
    expert = 3 * h * i
    emb = v * h * (1 if model_cfg.get("tie_word_embeddings") else 2)
    return {"total": emb + L * (attn + e * expert + e * h), "active": emb + L * (attn + k * expert + e * h)}
