"""The sampler's non-GEMM ops and its linear / grouped-expert dispatch, in the two numerics it can run.

``non_gemm`` (``EngineRecipe.non_gemm``):
    "hf"    transformers' exact op semantics, so that the aligned arm's sampler reproduces the trainer (an
            upstream ``Qwen3MoeForCausalLM``) bit for bit: RMSNorm normalises in fp32, casts to the input dtype,
            THEN multiplies by the BF16 weight (``Qwen3MoeRMSNorm``); the residual add is a BF16 add; rotary
            is transformers' own ``apply_rotary_pos_emb`` on BF16 cos/sin from its ``Qwen3MoeRotaryEmbedding``;
            SiLU(gate) * up in BF16 (two roundings); router = BF16 logits, fp32 softmax, top-k, renormalise,
            cast to BF16 (``Qwen3MoeTopKRouter``); experts combine like transformers' ``grouped_mm`` experts
            (BF16 output x BF16 routing weight, then a sum over the k experts with one rounding).
    "vllm"  the fused single-rounding fp32 kernels of the contract (docs/ENGINES.md): residual add fused into
            RMSNorm, normalisation AND weight multiply in fp32, one cast; rotary in fp32 from a fp32 cos/sin
            cache, one cast; SiLU(gate) * up in fp32, one cast; router softmax / renormalisation in fp32 with
            fp32 routing weights applied to the expert outputs in fp32 and one rounding after the k-sum.
            (Note: vLLM's own CUDA RMSNorm casts x * rsqrt to BF16 before the weight multiply; the contract's
            "vllm" mode is the fully fused variant, the larger departure from transformers.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minite import nvfp4
from minite.engines.arms import EngineRecipe, QuantSpec
from minite.engines.gemm import hp_linear, nvfp4_gemm, nvfp4_linear, quantize_activation
from minite.engines.sampler_weights import Experts, Lin
from minite import kernels

NON_GEMM = ("hf", "vllm")
#: ModelOpt / vLLM: input_scale = amax / (6 * 448)
FP4_E4M3_RANGE = 6.0 * 448.0


# ------------------------------------------------------------------------------------------- norms / act
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str) -> torch.Tensor:
    if mode == "hf":  # Qwen3MoeRMSNorm.forward, op for op
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + eps)
        return weight * h.to(dtype)
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return (h * torch.rsqrt(var + eps) * weight.to(torch.float32)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, mode: str):
    """(norm(residual + x), residual + x). "hf": BF16 add, then the norm of the rounded sum (transformers'
    decoder layer); "vllm": the sum stays fp32 inside the fused kernel, only the stored residual is rounded."""
    if mode == "hf":
        r = residual + x
        return rms_norm(r, weight, eps, "hf"), r
    s = x.to(torch.float32) + residual.to(torch.float32)
    var = s.pow(2).mean(-1, keepdim=True)
    out = (s * torch.rsqrt(var + eps) * weight.to(torch.float32)).to(x.dtype)
    return out, s.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "hf":
        return F.silu(gate) * up
    return (F.silu(gate.to(torch.float32)) * up.to(torch.float32)).to(gate.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Rotary:
    """Rotary embedding for q/k [B, H, T, D] at positions [B, T]."""

    def __init__(self, hf_config, mode: str, max_positions: int, device):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

        self.mode = mode
        self.hf = Qwen3MoeRotaryEmbedding(hf_config).to(device)  # inv_freq per the config's rope type/theta
        if mode == "vllm":  # fp32 cos/sin cache, as vLLM's rotary kernel reads it
            pos = torch.arange(max_positions, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self.hf.inv_freq.to(device=device, dtype=torch.float32)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos = emb.cos() * self.hf.attention_scaling
            self.sin = emb.sin() * self.hf.attention_scaling

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        if self.mode == "hf":
            from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

            cos, sin = self.hf(q, positions)  # [B, T, D] in q's dtype, transformers' own computation
            return apply_rotary_pos_emb(q, k, cos, sin)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, D]

        def rot(x):
            x32 = x.to(torch.float32)
            return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)
        return rot(q), rot(k)


# ------------------------------------------------------------------------------------------------ linears
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


class Calibrator:
    """Records the max |activation| per linear over the valid (non-padding) rows of a calibration pass."""

    def __init__(self):
        self.amax: dict[str, torch.Tensor] = {}

    def record(self, name: str, x2d: torch.Tensor, valid: torch.Tensor | None) -> None:
        rows = x2d if valid is None else x2d[valid]
        if rows.numel() == 0:
            return
        m = rows.detach().abs().amax().to(torch.float32)
        self.amax[name] = m if name not in self.amax else torch.maximum(self.amax[name], m)


def linear(x: torch.Tensor, lin: Lin, recipe: EngineRecipe, calib: Calibrator | None = None,
           valid: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T. BF16 weights: a plain BF16 matmul. NVFP4: ``nvfp4_linear`` per the recipe. During
    calibration the activation is left unquantized (ModelOpt calibrates with input quantizers collecting,
    not quantizing): x @ dequantize(W)^T in BF16."""
    if not lin.quantized:
        return hp_linear(x, lin.weight, recipe.hp_gemm == "invariant")
    if calib is not None:
        calib.record(lin.name, x.reshape(-1, x.shape[-1]), valid)
        return F.linear(x, nvfp4.dequantize(lin.q).to(x.dtype))
    return nvfp4_linear(x, lin.q, recipe.activations, recipe.gemm,
                        static_scale(lin.amax, recipe.activations, lin.name))


# ------------------------------------------------------------------------------------------------ experts
def grouped_linear(xs: torch.Tensor, weights, offsets: torch.Tensor, recipe: EngineRecipe, amax, name: str,
                   calib: Calibrator | None = None, valid: torch.Tensor | None = None,
                   dequantized=None) -> torch.Tensor:
    """Rows of xs [S, K] sorted by expert; expert e owns rows offsets[e]:offsets[e+1]. Returns [S, N].
    ``dequantized()``: the stacked BF16 values of NVFP4 ``weights`` for the "emulated" path."""
    bounds = offsets.tolist()
    if isinstance(weights, list) and recipe.gemm == "emulated" and calib is None and dequantized is not None:
        # vLLM's / TE's emulation: quantize the activations, dequantize both, one BF16 grouped GEMM
        a = quantize_activation(xs, recipe.activations, static_scale(amax, recipe.activations, name))
        xs, weights = nvfp4.dequantize(a).to(xs.dtype), dequantized()
    if not isinstance(weights, list):  # BF16 [E, N, K]
        if xs.is_cuda and hasattr(torch, "_grouped_mm"):
            return torch._grouped_mm(xs, weights.transpose(-2, -1), offs=offsets[1:].to(torch.int32))
        out = xs.new_empty(xs.shape[0], weights.shape[1])
        for e in range(len(bounds) - 1):
            if bounds[e + 1] > bounds[e]:
                out[bounds[e]:bounds[e + 1]] = F.linear(xs[bounds[e]:bounds[e + 1]], weights[e])
        return out
    out = xs.new_empty(xs.shape[0], weights[0].shape[0])
    if calib is not None:
        calib.record(name, xs, valid)
        for e in range(len(bounds) - 1):
            if bounds[e + 1] > bounds[e]:
                w = nvfp4.dequantize(weights[e]).to(xs.dtype)
                out[bounds[e]:bounds[e + 1]] = F.linear(xs[bounds[e]:bounds[e + 1]], w)
        return out
    # one activation quantization for all rows (row / static scaling: identical to per-expert calls)
    a = quantize_activation(xs, recipe.activations, static_scale(amax, recipe.activations, name))
    if recipe.gemm == "kernel":  # the single grouped call site (minite.kernels, one launch for all experts)
        return kernels.grouped_nvfp4_gemm(a, weights, offsets.to(torch.int64), out_dtype=torch.float32
                                          ).to(xs.dtype)
    for e in range(len(bounds) - 1):  # the emulated path: one GEMM per non-empty expert
        if bounds[e + 1] > bounds[e]:
            y = nvfp4_gemm(a.rows(bounds[e], bounds[e + 1]), weights[e], recipe.gemm, torch.float32)
            out[bounds[e]:bounds[e + 1]] = y.to(xs.dtype)
    return out


def route(logits: torch.Tensor, top_k: int, norm_topk: bool, mode: str):
    """Router logits [T, E] -> (routing weights [T, k], expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top.to(logits.dtype) if mode == "hf" else top), idx


def moe(x: torch.Tensor, experts: Experts, weights: torch.Tensor, idx: torch.Tensor, recipe: EngineRecipe,
        calib: Calibrator | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts for tokens x [T, H]: rows sorted by expert, two grouped GEMMs, weighted k-sum."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    expert_sorted, perm = torch.sort(flat, stable=True)
    rows = perm // k
    counts = torch.bincount(expert_sorted, minlength=experts.num_experts)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    vrows = None if valid is None else valid[rows]
    h = grouped_linear(x[rows], experts.gate_up, offsets, recipe, experts.gate_up_amax,
                       f"{experts.name}.gate_up", calib, vrows, lambda: experts.dequantized("gate_up"))
    gate, up = h.chunk(2, dim=-1)
    h = silu_mul(gate, up, recipe.non_gemm)
    y = grouped_linear(h, experts.down, offsets, recipe, experts.down_amax, f"{experts.name}.down", calib, vrows,
                       lambda: experts.dequantized("down"))
    out = torch.empty_like(y)
    out[perm] = y  # back to (token, k) order
    out = out.view(t, k, -1)
    if recipe.non_gemm == "hf":  # transformers' grouped_mm experts: BF16 product, k-sum with one rounding
        return (out * weights.reshape(t, k, 1)).sum(dim=1).to(x.dtype)
    return (out.to(torch.float32) * weights.reshape(t, k, 1)).sum(dim=1).to(x.dtype)


# ------------------------------------------------------------------------------------------------ sampling
def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (fp32) -> token ids [B]. temperature 0 = greedy; top_p keeps the smallest set of most
    likely tokens whose probability reaches top_p (the token that crosses it included)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True, stable=True)  # ties: lowest id first, as argmax
        drop = (sp.cumsum(dim=-1) - sp) >= top_p  # mass before this token already reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    if generator is not None and generator.device != probs.device:  # e.g. a CPU generator, CUDA logits
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
