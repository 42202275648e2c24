"""Write / read a ModelOpt-NVFP4 checkpoint of a Qwen3-MoE policy: the format vLLM serves.

Layout (what vLLM's ``ModelOptNvFp4Config`` / ``ModelOptNvFp4LinearMethod`` / ``ModelOptNvFp4FusedMoE`` load):
  model.safetensors, for every quantized linear ``<module>``:
      <module>.weight          uint8 [N, K/2]    two E2M1 codes per byte, element 2j in the low nibble
      <module>.weight_scale    float8_e4m3fn [N, K/16]
      <module>.weight_scale_2  fp32 scalar       the weight's global decode scale (amax / 2688 for ModelOpt)
      <module>.input_scale     fp32 scalar       static activation scale amax / 2688 from calibration
    unquantized tensors (embeddings, norms, router ``mlp.gate``, lm_head, high-precision layers) in BF16.
    Names are transformers' checkpoint names, with the experts per expert as vLLM's Qwen3-MoE loader expects
    them: ``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}`` (vLLM fuses them into w13/w2).
    q/k/v are written as separate modules (vLLM fuses them into qkv_proj and takes the max of their
    ``weight_scale_2`` / ``input_scale``: a shared-scale export, as ModelOpt writes, loses nothing there).
  hf_quant_config.json   {"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "NVFP4",
                          "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": [...]}}
  config.json            the HF Qwen3MoeConfig, with the same block as ``quantization_config``
  export_provenance.json git sha, command, date, arm, what was exported.

The exporter takes a Sampler (its fused, quantized weights and calibrated amax: the naive arm's sampler IS
the ModelOpt checkpoint vLLM would serve), a trainer (``export_weights()``) or a sync payload. A BF16 payload
is quantized as ModelOpt does (formula "modelopt", 1x16 blocks, one weight_scale_2 shared by q/k/v and by
gate/up); a codes payload is written as it is (each shard keeps its own weight_scale_2).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from minite import nvfp4
from minite.engines.arms import Arm, EngineRecipe, QuantSpec
from minite.engines.sampler_ops import FP4_E4M3_RANGE
from minite.engines.sampler_weights import SamplerWeights, build_sampler_weights, split_rows
from minite.provenance import atomic_path, provenance, write_json

MODELOPT_VERSION = "0.47.0"  # the ModelOpt formula minite.nvfp4 "modelopt" reproduces
DEFAULT_HIGH_PRECISION = ("embed_tokens", "router", "lm_head")


def _recipe_for(payload: dict, arm: Arm | None) -> EngineRecipe:
    if payload.get("form") == "nvfp4_codes":
        hp = arm.trainer.high_precision if arm is not None else DEFAULT_HIGH_PRECISION
        return EngineRecipe("nvfp4", "emulated", "sdpa", "vllm", tuple(hp), weights="from_trainer",
                            activations=QuantSpec("vllm", (1, 16), "static", "shared"))
    hp = arm.sampler.high_precision if arm is not None and arm.sampler.is_nvfp4 else DEFAULT_HIGH_PRECISION
    return EngineRecipe("nvfp4", "emulated", "sdpa", "vllm", tuple(hp),
                        weights=QuantSpec("modelopt", (1, 16), "tensor", "shared"),
                        activations=QuantSpec("vllm", (1, 16), "static", "shared"))


def _scalar(g: torch.Tensor, where: str) -> torch.Tensor:
    if g.dim() == 0:
        return g.to(torch.float32).clone()
    if not bool((g == g[0]).all()):
        raise ValueError(f"{where}: rows carry different global scales; a ModelOpt module has one weight_scale_2")
    return g[0].to(torch.float32).clone()


class _Writer:
    def __init__(self, amax: dict):
        self.t, self.amax, self.exclude = {}, amax, []

    def dense(self, name, w):
        self.t[name] = w.detach().to("cpu", torch.bfloat16).contiguous()

    def quant(self, module, q: nvfp4.NVFP4Tensor, amax_key):
        if amax_key not in self.amax or self.amax[amax_key] is None:
            raise ValueError(f"{module}: no calibrated input amax ({amax_key}); run sampler.calibrate(prompts) "
                             "or pass input_amax")
        self.t[f"{module}.weight"] = q.codes.detach().cpu().contiguous()
        self.t[f"{module}.weight_scale"] = q.scales.detach().cpu().contiguous()
        self.t[f"{module}.weight_scale_2"] = _scalar(q.global_scale.detach().cpu(), module)
        a = torch.as_tensor(self.amax[amax_key], dtype=torch.float32).detach().cpu().reshape(())
        self.t[f"{module}.input_scale"] = a / FP4_E4M3_RANGE

    def linear(self, lin):
        """One sampler linear (possibly fused) -> its checkpoint modules, one per transformers parameter."""
        for param, part in lin.shards().items():
            module = param.removesuffix(".weight")
            if lin.quantized:
                self.quant(module, part, lin.name)
            else:
                self.dense(param, part)
                self.exclude.append(module)


def _tensors(w: SamplerWeights, amax: dict) -> tuple[dict, list[str]]:
    out = _Writer(amax)
    out.dense("model.embed_tokens.weight", w.embed)
    out.dense("model.norm.weight", w.norm)
    out.linear(w.lm_head)
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}"
        for n, t in (("input_layernorm", lw.input_norm), ("post_attention_layernorm", lw.post_norm),
                     ("self_attn.q_norm", lw.q_norm), ("self_attn.k_norm", lw.k_norm)):
            out.dense(f"{p}.{n}.weight", t)
        out.linear(lw.qkv)
        out.linear(lw.o)
        if lw.experts is None:
            out.linear(lw.gate_up)
            out.linear(lw.down)
            continue
        out.linear(lw.router)
        ex = lw.experts
        for e in range(ex.num_experts):
            m = f"{ex.name}.{e}"
            if ex.quantized:
                half = ex.gate_up[e].shape[0] // 2
                g, u = split_rows(ex.gate_up[e], [half, half])
                out.quant(f"{m}.gate_proj", g, f"{ex.name}.gate_up")
                out.quant(f"{m}.up_proj", u, f"{ex.name}.gate_up")
                out.quant(f"{m}.down_proj", ex.down[e], f"{ex.name}.down")
            else:
                half = ex.gate_up.shape[1] // 2
                out.dense(f"{m}.gate_proj.weight", ex.gate_up[e, :half])
                out.dense(f"{m}.up_proj.weight", ex.gate_up[e, half:])
                out.dense(f"{m}.down_proj.weight", ex.down[e])
        if not ex.quantized:
            out.exclude.append(ex.name)
    return out.t, out.exclude


def export_modelopt(source, model_cfg, out_dir, input_amax: dict | None = None, arm: Arm | None = None) -> Path:
    """Write a ModelOpt-NVFP4 checkpoint directory (module docstring). ``source``: a Sampler, a trainer or a
    sync payload; ``input_amax``: calibrated activation amax per sampler linear name (``sampler.input_amax()``
    / ``sampler.calibrate`` returns it; a Sampler source brings its own). Returns the directory."""
    from minite.engines.sampler import hf_config_of

    cfg = hf_config_of(model_cfg)
    amax = {}
    if hasattr(source, "input_amax") and hasattr(source, "weights"):  # a Sampler
        weights = source._need_weights()
        amax.update(weights.amax_dict())
        arm = arm or source.arm
    else:
        payload = source.export_weights() if hasattr(source, "export_weights") else source
        weights = build_sampler_weights(payload, _recipe_for(payload, arm), cfg, "cpu")
    amax.update(input_amax or {})
    if not any(lin.quantized for lin in weights.linears()):
        raise ValueError("nothing to export as NVFP4: every linear of this source is BF16 (a bf16 sampler?)")
    tensors, exclude = _tensors(weights, amax)
    quant = {"producer": {"name": "modelopt", "version": f"{MODELOPT_VERSION} (minite export)"},
             "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                              "exclude_modules": exclude}}
    config = cfg.to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save

    with atomic_path(out / "model.safetensors", "wb") as f:
        f.write(save(tensors, metadata={"format": "pt"}))
    write_json(out / "hf_quant_config.json", quant)
    write_json(out / "config.json", config)
    write_json(out / "export_provenance.json", {**provenance(), "arm": arm.name if arm else None,
                                                "tensors": len(tensors), "excluded": exclude})
    return out


def load_modelopt(path) -> dict:
    """Read a checkpoint written by ``export_modelopt``: {"config", "quant_config", "tensors" (raw),
    "weights": {module: NVFP4Tensor} for quantized modules, "input_scale": {module: fp32 scalar}}."""
    from safetensors.torch import load_file

    path = Path(path)
    for f in ("model.safetensors", "hf_quant_config.json", "config.json"):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path}: not a ModelOpt NVFP4 checkpoint dir (missing {f})")
    quant = json.loads((path / "hf_quant_config.json").read_text())
    if quant.get("quantization", {}).get("quant_algo") != "NVFP4":
        raise ValueError(f"{path}: hf_quant_config.json quant_algo is not NVFP4")
    tensors = load_file(str(path / "model.safetensors"))
    weights, scales = {}, {}
    for name in tensors:
        if name.endswith(".weight_scale_2"):
            m = name[: -len(".weight_scale_2")]
            weights[m] = nvfp4.NVFP4Tensor(tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"], tensors[name])
            scales[m] = tensors.get(f"{m}.input_scale")
    return {"config": json.loads((path / "config.json").read_text()), "quant_config": quant,
            "tensors": tensors, "weights": weights, "input_scale": scales}
