"""The sampler's weights: its fused layout, and how a sync payload becomes it.

The sampler fuses q/k/v into one QKV weight (rows q, k, v) and keeps each expert's gate/up fused (rows gate,
up), then, per ``arm.sampler``:
  * BF16 form, NVFP4 sampler: quantizes the BF16 weights itself with ``arm.sampler.weights`` (naive arm:
    formula "modelopt", 1x16, ``fused_shards: shared`` = one per-tensor global scale over the fused q/k/v
    or gate/up shards, i.e. quantizing the fused tensor; ``per_shard`` = each shard its own, concatenated).
  * codes form (``weights: from_trainer``): the trainer's NVFP4Tensors as they are; fusing concatenates rows
    and turns per-shard global scales into a per-row global scale [N].
``build_sampler_weights(payload, recipe, hf_config)`` does this; the payload format is ``minite.engines.sync``'s.
NVFP4 experts are stacked once (``minite.kernels.NVFP4Experts``, what the grouped GEMM reads; the per-expert
list is views into it). ``SamplerWeights.prepare(recipe)`` then makes the decode-time forms, once per sync and
never inside a decode step: BF16 dequantized copies for the emulated GEMM path, for the kernel path the dense
weights' fp16 copies and fragment-order codes (``kernels.decode_layout``), and static activation scales as
host numbers. ``SamplerWeights.copy_(other)`` updates the weights in place (a re-sync keeps the tensors that
captured CUDA graphs read).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from minite import kernels, nvfp4
from minite.engines.arms import EngineRecipe, QuantSpec
from minite.engines.names import is_quantized, param_kind

#: payload forms (``{"form": ..., "tensors": ...}``, see ``minite.engines.sync``)
FORMS = ("bf16", "nvfp4_codes")
#: ModelOpt / vLLM: input_scale = amax / (6 * 448)
FP4_E4M3_RANGE = 6.0 * 448.0


def static_scale(amax: torch.Tensor | None, spec: QuantSpec, name: str) -> torch.Tensor | None:
    """The value ``minite.engines.gemm`` takes for static scaling: vLLM's encode scale G = 1 / input_scale
    with input_scale = amax / 2688 as the ModelOpt checkpoint stores it ("vllm"), else the amax itself."""
    if spec.scaling != "static":
        return None
    if amax is None:
        raise RuntimeError(f"{name}: static activation scaling needs calibration; call sampler.calibrate(prompts)")
    if spec.formula == "vllm":
        input_scale = amax.to(torch.float32) / FP4_E4M3_RANGE
        return 1.0 / input_scale
    return amax


def host_static_scale(amax: torch.Tensor | None, spec: QuantSpec | None) -> float | None:
    """``static_scale`` as a host number (the same fp32 value, computed where amax lives; one device read):
    what a decode step passes to the quantizer, so the step reads nothing back from the device. None when
    the scaling is not static or the linear is not calibrated yet (the step then raises ``static_scale``'s
    error)."""
    if spec is None or spec.scaling != "static" or amax is None:
        return None
    return float(static_scale(amax, spec, ""))


# ------------------------------------------------------------------------------------------------ linears
@dataclass
class Lin:
    """One sampler linear: a BF16 weight [N, K] or an NVFP4 weight, plus its calibrated activation amax.
    ``params`` / ``rows``: the transformers parameters whose rows it fuses, in order, and their row counts."""
    name: str
    weight: torch.Tensor | None = None
    q: nvfp4.NVFP4Tensor | None = None
    amax: torch.Tensor | None = None          # static activation amax (fp32 scalar), set by calibration
    params: tuple[str, ...] = ()
    rows: tuple[int, ...] = ()
    act_scale: float | None = None            # static_scale(amax) as a host number (``prepare``)
    deq: torch.Tensor | None = None           # BF16 dequantized weight for the emulated GEMM (``prepare``)
    decode: object = None                     # q's fp16 copy and fragment-order codes, kernel path (``prepare``)

    @property
    def quantized(self) -> bool:
        return self.q is not None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.q.codes, self.q.scales, self.q.global_scale] if self.quantized else [self.weight]
        out += [t for t in (getattr(self.decode, "f16", None), getattr(self.decode, "frag", None)) if t is not None]
        return out + ([self.deq] if self.deq is not None else [])

    def shards(self) -> dict[str, torch.Tensor | nvfp4.NVFP4Tensor]:
        """The weight split back into the parameters it fuses: {parameter name: its rows}."""
        parts = split_rows(self.q, self.rows) if self.quantized else self.weight.split(list(self.rows))
        return dict(zip(self.params, parts, strict=True))


# ------------------------------------------------------------------------------------------------ experts
@dataclass
class Experts:
    """E experts: fused gate/up [E, 2I, H] and down [E, H, I], BF16 stacked or lists of NVFP4Tensors.
    A list is stacked once on construction (``stacked[part]``: an ``NVFP4Experts``, what the grouped GEMM
    reads) and becomes views into the stack. ``gate_up_amax`` / ``down_amax``: one static amax per layer
    (vLLM collapses per-expert input scales to their max when it loads a ModelOpt MoE)."""
    name: str
    gate_up: torch.Tensor | list
    down: torch.Tensor | list
    gate_up_amax: torch.Tensor | None = None
    down_amax: torch.Tensor | None = None
    act_scale: dict = field(default_factory=dict)  # part -> static_scale(amax) as a host number (``prepare``)
    stacked: dict = field(default_factory=dict)    # part -> NVFP4Experts (NVFP4 experts only)

    def __post_init__(self):
        if self.quantized:
            for part in ("gate_up", "down"):
                ex = kernels.stack_experts(getattr(self, part))
                self.stacked[part] = ex
                g = ex.global_scale
                setattr(self, part, [nvfp4.NVFP4Tensor(ex.codes[e], ex.scales[e], g[e]) for e in range(len(g))])

    @property
    def quantized(self) -> bool:
        return isinstance(self.gate_up, list)

    def tensors(self) -> list[torch.Tensor]:
        if not self.quantized:
            return [self.gate_up, self.down]
        out = [t for part in ("gate_up", "down") for t in (self.stacked[part].codes, self.stacked[part].scales,
                                                            self.stacked[part].global_scale)]
        out += [self.stacked[p].frag for p in ("gate_up", "down") if self.stacked[p].frag is not None]
        return out + [self.__dict__["_deq"][p] for p in ("gate_up", "down") if p in self.__dict__.get("_deq", {})]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def shards(self) -> dict[str, torch.Tensor | list]:
        """{transformers parameter name: its weights} (``mlp.experts.gate_up_proj`` / ``down_proj``)."""
        return {f"{self.name}.gate_up_proj": self.gate_up, f"{self.name}.down_proj": self.down}

    def dequantized(self, part: str) -> torch.Tensor:
        """Stacked BF16 dequantized weights [E, N, K] of "gate_up" / "down", made once per sync: the emulated
        GEMM path multiplies by exactly these values, so caching them changes no bit."""
        cache = self.__dict__.setdefault("_deq", {})
        if part not in cache:
            cache[part] = torch.stack([nvfp4.dequantize(w).to(torch.bfloat16) for w in getattr(self, part)])
        return cache[part]


# ------------------------------------------------------------------------------------------------ layers
@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    qkv: Lin
    o: Lin
    router: Lin | None = None
    experts: Experts | None = None
    gate_up: Lin | None = None      # dense (non-MoE) layers only
    down: Lin | None = None


@dataclass
class SamplerWeights:
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: Lin
    layers: list[LayerWeights] = field(default_factory=list)

    def linears(self) -> list[Lin]:
        out = []
        for lw in self.layers:
            out += [x for x in (lw.qkv, lw.o, lw.router, lw.gate_up, lw.down) if x is not None]
        return out + [self.lm_head]

    def experts(self) -> list[Experts]:
        return [lw.experts for lw in self.layers if lw.experts is not None]

    # ------------------------------------------------------------------------------------ decode forms
    def prepare(self, recipe: EngineRecipe) -> None:
        """The forms a decode step reads, made here (after a sync or a calibration), not inside the step:
        for the emulated GEMM path the BF16 dequantized weights (the values it multiplies by, so caching
        changes no bit), for the kernel path the dense weights' fp16 copy (``kernels.prepare_weight``: read
        at prefill, and by wide weights at 17-64 decode rows) and the codes in the CUDA decode kernel's
        fragment order (``kernels.decode_layout``: same bits), and static activation scales as host numbers."""
        emulated, act = recipe.gemm == "emulated", recipe.activations
        for lin in self.linears():
            if lin.quantized:
                lin.act_scale = host_static_scale(lin.amax, act)
                lin.deq = nvfp4.dequantize(lin.q).to(torch.bfloat16) if emulated else None
                lin.decode = kernels.decode_layout(kernels.prepare_weight(lin.q)) if recipe.gemm == "kernel" \
                    else None
        for ex in self.experts():
            if ex.quantized:
                ex.act_scale = {p: host_static_scale(getattr(ex, f"{p}_amax"), act) for p in ("gate_up", "down")}
                if emulated:
                    ex.dequantized("gate_up"), ex.dequantized("down")
                elif recipe.gemm == "kernel":  # the decode kernel's fragment-order codes (CUDA decode path only)
                    ex.stacked = {p: kernels.decode_layout(ex.stacked[p]) for p in ("gate_up", "down")}

    def act_scales(self) -> list:
        """Every static activation scale a decode step bakes in (a change means new CUDA graphs)."""
        return [lin.act_scale for lin in self.linears()] + [sorted(ex.act_scale.items()) for ex in self.experts()]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a forward reads, in a fixed order (``copy_``)."""
        out = [self.embed, self.norm, *self.lm_head.tensors()]
        for lw in self.layers:
            out += [lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm]
            for part in (lw.qkv, lw.o, lw.router, lw.gate_up, lw.down, lw.experts):
                if part is not None:
                    out += part.tensors()
        return out

    def copy_(self, other: SamplerWeights) -> bool:
        """Copy ``other``'s values into these tensors in place (same layout: shapes, dtypes, static scales);
        returns False and changes nothing when the layouts differ."""
        mine, theirs = self.tensors(), other.tensors()
        if len(mine) != len(theirs) or self.act_scales() != other.act_scales() or any(
                a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                for a, b in zip(mine, theirs, strict=True)):
            return False
        for a, b in zip(mine, theirs, strict=True):
            a.copy_(b)
        for lin, src in zip(self.linears(), other.linears(), strict=True):
            lin.amax = src.amax
        for ex, src in zip(self.experts(), other.experts(), strict=True):
            ex.gate_up_amax, ex.down_amax = src.gate_up_amax, src.down_amax
        return True

    def amax_dict(self) -> dict[str, torch.Tensor]:
        d = {lin.name: lin.amax for lin in self.linears() if lin.quantized and lin.amax is not None}
        for lw in self.layers:
            if lw.experts is not None and lw.experts.quantized:
                for part in ("gate_up", "down"):
                    a = getattr(lw.experts, f"{part}_amax")
                    if a is not None:
                        d[f"{lw.experts.name}.{part}"] = a
        return d

    def set_amax(self, amax: dict[str, torch.Tensor]) -> None:
        for lin in self.linears():
            if lin.quantized:
                if lin.name not in amax:
                    raise RuntimeError(f"calibration saw no tokens for {lin.name}; calibrate with more prompts")
                lin.amax = amax[lin.name]
        for lw in self.layers:
            if lw.experts is not None and lw.experts.quantized:
                for part in ("gate_up", "down"):
                    key = f"{lw.experts.name}.{part}"
                    if key not in amax:
                        raise RuntimeError(f"calibration saw no tokens for {key}; calibrate with more prompts")
                    setattr(lw.experts, f"{part}_amax", amax[key])

    def copy_amax_from(self, other: SamplerWeights) -> None:
        amax = other.amax_dict()
        if amax:
            self.set_amax(amax)


# ------------------------------------------------------------------------------------- fused NVFP4 weights
def cat_rows(parts: list[nvfp4.NVFP4Tensor]) -> nvfp4.NVFP4Tensor:
    """Fuse NVFP4 shards along N: codes and scales concatenate; global scales become per-row [N] unless all
    shards share one scalar."""
    gs = [p.global_scale for p in parts]
    if all(g.dim() == 0 for g in gs) and all(bool(g == gs[0]) for g in gs):
        g = gs[0].clone()
    else:
        g = torch.cat([p.row_global_scale() for p in parts])
    return nvfp4.NVFP4Tensor(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), g)


def split_rows(t: nvfp4.NVFP4Tensor, sizes: list[int]) -> list[nvfp4.NVFP4Tensor]:
    """A fused NVFP4 weight -> its shards of ``sizes`` rows (the inverse of ``cat_rows``)."""
    return [t.rows(end - n, end) for n, end in zip(sizes, accumulate(sizes), strict=True)]


def quantize_weight(shards: list[torch.Tensor], spec: QuantSpec) -> nvfp4.NVFP4Tensor:
    """Quantize BF16 shards [n_i, K] of one fused weight per ``spec`` (shared or per-shard global scale).
    16x16 tiles fall back to 1x16 blocks where a shard's N is not a multiple of 16 (e.g. an 8-expert
    router), as the trainer's quant_linear does."""
    def q(w):
        kw = spec.quantize_kwargs()
        if kw["tile"] == (16, 16) and w.shape[0] % 16:
            kw["tile"] = (1, 16)
        return nvfp4.quantize(w.to(torch.bfloat16).float(), **kw)
    if spec.fused_shards == "shared" or len(shards) == 1:
        return q(torch.cat(shards) if len(shards) > 1 else shards[0])
    return cat_rows([q(s) for s in shards])


def quantize_experts(w: torch.Tensor, spec: QuantSpec, shards: int = 1) -> list[nvfp4.NVFP4Tensor]:
    """Stacked BF16 expert weights [E, N, K] -> one NVFP4Tensor per expert, its rows quantized as ``shards``
    equal shards (2 for ``gate_up_proj``: gate and up) per ``spec``."""
    return [quantize_weight(list(e.chunk(shards)), spec) for e in w]


# ------------------------------------------------------------------------------------------ from a payload
class _Builder:
    """Turns payload tensors into the sampler's fused Lin / Experts per the sampler recipe."""

    def __init__(self, payload: dict, recipe: EngineRecipe, hf_config, device):
        if not isinstance(payload, dict) or payload.get("form") not in FORMS or "tensors" not in payload:
            raise ValueError(f"sync payload: expected {{'form': one of {FORMS}, 'tensors': {{...}}}}")
        self.form, self.t, self.recipe, self.device = payload["form"], payload["tensors"], recipe, device
        self.n, self.tied = hf_config.num_hidden_layers, hf_config.tie_word_embeddings
        if self.form == "nvfp4_codes" and recipe.is_nvfp4 and recipe.weights != "from_trainer":
            raise ValueError("codes payload but arm.sampler.weights is not 'from_trainer'")
        if self.form == "bf16" and recipe.weights == "from_trainer":
            raise ValueError("arm.sampler.weights: from_trainer needs an nvfp4_codes payload, got bf16")

    def get(self, name):
        if name == "lm_head.weight" and name not in self.t and self.tied:
            name = "model.embed_tokens.weight"  # tied embeddings: the head is the embedding
        if name not in self.t:
            raise KeyError(f"sync payload is missing {name!r}")
        return self.t[name]

    def dense(self, name) -> torch.Tensor:
        v = self.get(name)
        if isinstance(v, nvfp4.NVFP4Tensor):
            raise ValueError(f"{name}: expected a BF16 tensor (a norm / embedding), got NVFP4 codes")
        return v.detach().to(self.device, torch.bfloat16, copy=True)

    def lin(self, lin_name: str, params: list[str]) -> Lin:
        """One linear fusing the rows of ``params`` (one kind of module, e.g. q/k/v)."""
        vals = [self.get(n) for n in params]
        kind, _ = param_kind(params[0])
        want_q = is_quantized(self.recipe, params[0], self.n)
        fused = {"params": tuple(params), "rows": tuple(v.shape[0] for v in vals)}
        is_q = [isinstance(v, nvfp4.NVFP4Tensor) for v in vals]
        if any(is_q):
            if not all(is_q) or not want_q:
                raise ValueError(f"{lin_name}: the payload ships NVFP4 codes but arm.sampler keeps {kind} in "
                                 "high precision (both engines must keep the same modules in BF16)")
            return Lin(lin_name, q=cat_rows([v.to(self.device) for v in vals]), **fused)
        ws = [v.detach().to(self.device, torch.bfloat16, copy=True) for v in vals]  # never the caller's
        if not want_q:
            return Lin(lin_name, weight=torch.cat(ws) if len(ws) > 1 else ws[0], **fused)
        if self.form == "nvfp4_codes":
            raise ValueError(f"{lin_name}: codes payload has BF16 weights where arm.sampler quantizes {kind}")
        return Lin(lin_name, q=quantize_weight(ws, self.recipe.weights), **fused)

    def experts(self, i) -> Experts:
        p = f"model.layers.{i}.mlp.experts"
        gu, dn = self.get(f"{p}.gate_up_proj"), self.get(f"{p}.down_proj")
        want_q = is_quantized(self.recipe, f"{p}.gate_up_proj", self.n)
        if isinstance(gu, (list, tuple)):
            if not want_q:
                raise ValueError(f"{p}: payload ships NVFP4 experts but arm.sampler keeps experts in BF16")
            return Experts(p, [g.to(self.device) for g in gu], [d.to(self.device) for d in dn])
        gu = gu.detach().to(self.device, torch.bfloat16, copy=True).contiguous()
        dn = dn.detach().to(self.device, torch.bfloat16, copy=True).contiguous()
        if not want_q:
            return Experts(p, gu, dn)
        if self.form == "nvfp4_codes":
            raise ValueError(f"{p}: codes payload has BF16 experts where arm.sampler quantizes them")
        spec = self.recipe.weights
        return Experts(p, quantize_experts(gu, spec, shards=2), quantize_experts(dn, spec))


def build_sampler_weights(payload: dict, recipe: EngineRecipe, hf_config, device="cpu") -> SamplerWeights:
    """Payload -> the sampler's fused, (re)quantized weights per ``recipe`` (module docstring)."""
    b = _Builder(payload, recipe, hf_config, device)
    w = SamplerWeights(embed=b.dense("model.embed_tokens.weight"), norm=b.dense("model.norm.weight"),
                       lm_head=b.lin("lm_head", ["lm_head.weight"]))
    for i in range(b.n):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        lw = LayerWeights(
            input_norm=b.dense(f"{p}.input_layernorm.weight"),
            post_norm=b.dense(f"{p}.post_attention_layernorm.weight"),
            q_norm=b.dense(f"{a}.q_norm.weight"), k_norm=b.dense(f"{a}.k_norm.weight"),
            qkv=b.lin(f"{a}.qkv_proj", [f"{a}.{x}_proj.weight" for x in "qkv"]),
            o=b.lin(f"{a}.o_proj", [f"{a}.o_proj.weight"]))
        if f"{p}.mlp.gate.weight" in b.t:
            lw.router = b.lin(f"{p}.mlp.gate", [f"{p}.mlp.gate.weight"])
            lw.experts = b.experts(i)
        else:
            lw.gate_up = b.lin(f"{p}.mlp.gate_up_proj", [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"])
            lw.down = b.lin(f"{p}.mlp.down_proj", [f"{p}.mlp.down_proj.weight"])
        w.layers.append(lw)
    return w
