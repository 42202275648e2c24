"""The sampler's ops: non-GEMM ops in the two numerics it can run, its linear and grouped-expert dispatch,
decode attention over the slot-indexed KV cache, and sampling. Everything a decode step calls is free of
host synchronisation (no tensor read back to Python, no data-dependent shape), so the step can be captured
in a CUDA graph; the host loops left here serve calibration and the CPU-only per-expert paths.

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

import functools
import math

import torch
import torch.nn.functional as F

from minite import kernels, nvfp4
from minite.engines.arms import EngineRecipe
from minite.engines.gemm import (
    hp_linear,
    hp_linear_parts,
    nvfp4_gemm,
    nvfp4_linear,
    qdq_activation,
    quantize_activation,
    quantize_activation_rms_norm,
    quantize_activation_silu_mul,
)
from minite.engines.sampler_weights import FP4_E4M3_RANGE, Experts, Lin, static_scale  # noqa: F401
from minite.kernels import fused_ops

NON_GEMM = fused_ops.MODES  # the non-GEMM numerics the fused ops implement
ATTENTION_NUMERICS = ("fast", "invariant")  # decode_attention: BF16 SDPA (sdpa arms) | float64 (aligned)


# ------------------------------------------------------------------------------------------- norms / act
# Each op is ``minite.kernels.fused_ops``: fused Triton passes on CUDA, bit for bit the op-by-op reference
# (which is what runs on CPU); their sums in torch's own orders (torch's kernels, or passes that reproduce them).
def add_rms_norm(x, residual: torch.Tensor, weight: torch.Tensor, eps: float, mode: str):
    """(norm(residual + x), residual + x). "hf": BF16 add, then the norm of the rounded sum (transformers'
    decoder layer); "vllm": the sum stays fp32 inside the fused op, only the stored residual is rounded. x: a
    tensor or the experts' ``RoutedRows`` (then their combine)."""
    return fused_ops.rms_norm(x, weight, eps, mode, residual=residual)


def norm_codes_reused(recipe: EngineRecipe, calib: Calibrator | None) -> bool:
    """Whether every NVFP4 linear of the recipe quantizes its input the same way whichever linear it is: the
    kernel path with per-row scales (no per-linear static scale; no calibration pass, which records the
    unquantized input). Then a norm's last pass can write its output's codes once for the linears after it."""
    return calib is None and recipe.gemm == "kernel" and recipe.activations.scaling == "row"


def rms_norm_for_linears(x, weight: torch.Tensor, eps: float, recipe: EngineRecipe,
                         residual: torch.Tensor | None = None, calib: Calibrator | None = None,
                         next_lin: Lin | None = None):
    """(y, residual + x or None, y's codes or None): ``rms_norm`` / ``add_rms_norm`` for a norm whose output
    NVFP4 linears read next. Where ``norm_codes_reused``, the norm's last pass is their activation cast
    (``kernels.quantize_rms_norm``, bit for bit the two calls; one launch less) and the linears take the codes
    (``linear(..., codes=)``, ``moe(..., codes=)``); else codes is None and each linear quantizes y. x: a
    tensor or the experts' ``RoutedRows`` (their combine taken in the norm's pass where it can be).
    ``next_lin``: the one linear that reads the codes; where its GEMM reads the tokens as fp16
    (``kernels.reads_f16_tokens``), that pass writes them so too, and the GEMM skips its decode pass."""
    mode = recipe.non_gemm
    if not norm_codes_reused(recipe, calib):
        out = fused_ops.rms_norm(x, weight, eps, mode, residual=residual)
        return (out, None, None) if residual is None else (*out, None)
    w = next_lin.decode if next_lin is not None and next_lin.quantized else None
    rows = math.prod(x.shape[:-1])
    out = quantize_activation_rms_norm(x, weight, eps, mode, recipe.activations, residual=residual,
                                       f16=w is not None and kernels.reads_f16_tokens(w, rows))
    return (out[0], None, out[1]) if residual is None else out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, mode: str) -> torch.Tensor:
    return fused_ops.silu_mul(gate, up, mode)


class Rotary:
    """Rotary tables for positions [B, T] (applied by ``fused_ops.qk_norm_rope`` with the q/k norms)."""

    def __init__(self, hf_config, mode: str, max_positions: int, device):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

        self.mode = mode
        self.max_positions = int(max_positions)
        self.hf = Qwen3MoeRotaryEmbedding(hf_config).to(device)  # inv_freq per the config's rope type/theta
        self._hf_tables: dict[torch.dtype, torch.Tensor] = {}
        # a dynamic rope rescales by the longest position in the call: tables only where it never does
        self._tabled = mode == "hf" and getattr(self.hf, "rope_type", "default") not in ("dynamic", "longrope")
        if self._tabled:
            self.hf_table(torch.bfloat16)  # the sampler's activations: made here, never inside a graph capture
        if mode == "vllm":  # fp32 cos/sin cache, as vLLM's rotary kernel reads it
            pos = torch.arange(max_positions, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self.hf.inv_freq.to(device=device, dtype=torch.float32)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos = emb.cos() * self.hf.attention_scaling
            self.sin = emb.sin() * self.hf.attention_scaling

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin) for positions [B, T]: made once per forward, shared by every layer. "hf": rows of
        transformers' own tables, [B, T, D] in ``dtype`` (q's); "vllm": rows of the fp32 cache, [B, 1, T, D]."""
        table = self.gather_table(dtype)
        if table is not None:
            both = table[positions]                           # one gather for both: [B, T, 2, D]
            return both[..., 0, :], both[..., 1, :]
        if self.mode == "hf":
            return self.hf(torch.empty(0, dtype=dtype, device=positions.device), positions)
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def gather_table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[max_positions, 2, D] whose rows at positions [B] are ``tables``' (cos, sin) for positions [B, 1]
        (``hf_table``), or None where ``tables`` computes them otherwise."""
        return self.hf_table(dtype) if self._tabled else None

    def hf_table(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, 2, D]: transformers' cos and sin of every position, by its own module, once per
        dtype. A position's row does not depend on which positions share the call (an inv_freq x position
        product, elementwise cos / sin and scaling: no reduction), so the rows are the bits transformers
        computes for that position in any batch, without its ~8 launches per decode step."""
        if dtype not in self._hf_tables:
            dev = self.hf.inv_freq.device
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"rotary table for {dtype} first asked for inside a CUDA graph capture")
            pos = torch.arange(self.max_positions, device=dev)[None]
            cos, sin = self.hf(torch.empty(0, dtype=dtype, device=dev), pos)
            self._hf_tables[dtype] = torch.stack((cos[0], sin[0]), dim=1)
        return self._hf_tables[dtype]


# ------------------------------------------------------------------------------------------------ linears
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


def _scale(host: float | None, amax, recipe: EngineRecipe, name: str):
    """The static activation scale: the host number ``SamplerWeights.prepare`` made (nothing read back from
    the device), else computed from amax (raises when the linear needs calibration)."""
    return host if host is not None else static_scale(amax, recipe.activations, name)


def linear(x: torch.Tensor, lin: Lin, recipe: EngineRecipe, calib: Calibrator | None = None,
           valid: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           codes: nvfp4.NVFP4Tensor | None = None) -> torch.Tensor:
    """y = x W^T. BF16 weights: a plain BF16 matmul. NVFP4: ``nvfp4_linear`` per the recipe (the emulated
    path multiplies by the weight's cached BF16 dequantization, the same values). During calibration the
    activation is left unquantized (ModelOpt calibrates with input quantizers collecting, not quantizing):
    x @ dequantize(W)^T in BF16. ``out_dtype`` (float32): the BF16 result's values, stored wider. ``codes``:
    x's codes from ``rms_norm_for_linears`` (read by NVFP4 weights on the kernel path instead of a cast)."""
    if not lin.quantized:
        return hp_linear(x, lin.weight, recipe.hp_gemm == "invariant", out_dtype=out_dtype)
    y = _quantized_linear(x, lin, recipe, calib, valid, codes)
    return y if out_dtype is None else y.to(out_dtype)


def _quantized_linear(x, lin, recipe, calib, valid, codes=None):
    if calib is not None:
        calib.record(lin.name, x.reshape(-1, x.shape[-1]), valid)
        return F.linear(x, nvfp4.dequantize(lin.q).to(x.dtype))
    scale = _scale(lin.act_scale, lin.amax, recipe, lin.name)
    if recipe.gemm == "emulated" and lin.deq is not None:  # gemm.nvfp4_gemm's "emulated", weight cached
        lead, k = x.shape[:-1], x.shape[-1]
        y = F.linear(qdq_activation(x.reshape(-1, k), recipe.activations, scale), lin.deq)
        return y.to(x.dtype).reshape(*lead, lin.deq.shape[0])
    w = lin.decode if recipe.gemm == "kernel" and lin.decode is not None else lin.q
    return nvfp4_linear(x, w, recipe.activations, recipe.gemm, scale, codes=codes)


# ------------------------------------------------------------------------------------------------ experts
@functools.cache
def _grouped_mm_works(device_type: str) -> bool:
    """Whether ``torch._grouped_mm`` (one BF16 grouped GEMM, offsets read on the device) runs here."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    x = torch.zeros(2, 16, dtype=torch.bfloat16, device=device_type)
    w = torch.zeros(1, 16, 16, dtype=torch.bfloat16, device=device_type)
    try:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([2], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm(xs: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """BF16 rows xs [S, K] sorted by expert, stacked weights w [E, N, K] -> [S, N]: one ``torch._grouped_mm``
    (no host read), or, where it does not run, one matmul per non-empty expert."""
    if _grouped_mm_works(xs.device.type):
        return torch._grouped_mm(xs, w.transpose(-2, -1), offs=offsets[1:].to(torch.int32))
    bounds = offsets.tolist()
    out = xs.new_empty(xs.shape[0], w.shape[1])
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e]:bounds[e + 1]] = F.linear(xs[bounds[e]:bounds[e + 1]], w[e])
    return out


def grouped_linear(xs: torch.Tensor, weights, offsets: torch.Tensor, recipe: EngineRecipe, amax, name: str,
                   calib: Calibrator | None = None, valid: torch.Tensor | None = None,
                   dequantized=None, act_scale: float | None = None, rows: torch.Tensor | None = None,
                   silu_mode: str | None = None, codes: nvfp4.NVFP4Tensor | None = None) -> torch.Tensor:
    """Rows of xs [S, K] sorted by expert; expert e owns rows offsets[e]:offsets[e+1]. Returns [S, N].
    ``rows`` [S]: the sorted rows are xs[rows] (xs then holds each token once). ``silu_mode``: xs is a
    gate_up output [S, 2K] and the input is silu_mul(gate, up, silu_mode). On the kernel path with per-row or
    static activation scales (a row's codes do not depend on the other rows) the tokens are quantized once
    and the grouped kernel reads their rows in place (the codes of xs[rows], without the gathered copy), and
    the SiLU * up is computed inside the cast pass; every other path gathers / applies it first. ``codes``:
    xs's codes from ``rms_norm_for_linears``, read in place of that cast.
    ``weights``: BF16 [E, N, K], a list of E NVFP4Tensors, or their ``NVFP4Experts`` stack (what the grouped
    kernel reads). ``dequantized()``: the stacked BF16 values of NVFP4 ``weights`` for the "emulated" path.
    ``act_scale``: the static activation scale as a host number (else computed from ``amax``). Without
    calibration, every path but the CPU per-expert loops reads nothing back from the device."""
    nvfp4_w = not isinstance(weights, torch.Tensor)
    kernel = nvfp4_w and calib is None and recipe.gemm == "kernel"  # one quantization, one grouped launch
    in_place = kernel and recipe.activations.scaling in ("row", "static")
    if silu_mode is not None and not in_place:
        xs, silu_mode = silu_mul(*xs.chunk(2, dim=-1), silu_mode), None
    if rows is not None and not in_place:
        xs, rows = xs[rows], None
    if codes is not None and in_place:  # xs's codes, made by the norm before (row scales: the same bits)
        return kernels.grouped_nvfp4_gemm(codes, weights, offsets, out_dtype=xs.dtype, rows=rows)
    if kernel:
        scale = _scale(act_scale, amax, recipe, name)
        a = (quantize_activation(xs, recipe.activations, scale) if silu_mode is None else
             quantize_activation_silu_mul(*xs.chunk(2, dim=-1), silu_mode, recipe.activations, scale))
        return kernels.grouped_nvfp4_gemm(a, weights, offsets, out_dtype=xs.dtype, rows=rows)
    if nvfp4_w and recipe.gemm == "emulated" and calib is None and dequantized is not None:
        # vLLM's / TE's emulation: quantize the activations, dequantize both, one BF16 grouped GEMM
        xs = qdq_activation(xs, recipe.activations, _scale(act_scale, amax, recipe, name), xs.dtype)
        weights, nvfp4_w = dequantized(), False
    if not nvfp4_w:  # BF16 [E, N, K]
        return grouped_mm(xs, weights, offsets)
    ws = weights if isinstance(weights, list) else [
        nvfp4.NVFP4Tensor(weights.codes[e], weights.scales[e], weights.global_scale[e])
        for e in range(weights.codes.shape[0])]
    bounds = offsets.tolist()  # host loops: calibration, and the emulated path without cached weights
    out = xs.new_empty(xs.shape[0], ws[0].shape[0])
    if calib is not None:
        calib.record(name, xs, valid)
        for e in range(len(bounds) - 1):
            if bounds[e + 1] > bounds[e]:
                w = nvfp4.dequantize(ws[e]).to(xs.dtype)
                out[bounds[e]:bounds[e + 1]] = F.linear(xs[bounds[e]:bounds[e + 1]], w)
        return out
    # one activation quantization for all rows (row / static scaling: identical to per-expert calls)
    a = quantize_activation(xs, recipe.activations, _scale(act_scale, amax, recipe, name))
    for e in range(len(bounds) - 1):  # the emulated path without cached weights: one GEMM per expert
        if bounds[e + 1] > bounds[e]:
            y = nvfp4_gemm(a.rows(bounds[e], bounds[e + 1]), ws[e], recipe.gemm, torch.float32)
            out[bounds[e]:bounds[e + 1]] = y.to(xs.dtype)
    return out


def router(x: torch.Tensor, lin: Lin, top_k: int, norm_topk: bool, recipe: EngineRecipe,
           calib: Calibrator | None, valid: torch.Tensor | None, dtype: torch.dtype):
    """x [T, H] -> (logits: a function making the router logits [T, E] in ``dtype``, called for captures
    only; routing weights [T, k]; expert ids [T, k]): ``linear`` (fp32 storage), then ``route``. Where the
    invariant GEMM splits K (the router's narrow N), the routing kernel adds its partial sums itself
    (``kernels.route_parts``): the same bits, one launch fewer a layer."""
    parts = None if lin.quantized else hp_linear_parts(x, lin.weight, recipe.hp_gemm == "invariant")
    if parts is not None:
        weights, idx = kernels.route_parts(parts, x.dtype, top_k, norm_topk, recipe.non_gemm, dtype)
        return (lambda: kernels.sum_parts(parts, x.dtype).to(dtype)), weights, idx
    logits = linear(x, lin, recipe, calib, valid, out_dtype=torch.float32)  # the softmax's input
    weights, idx = route(logits, top_k, norm_topk, recipe.non_gemm, dtype)
    return (lambda: logits.to(dtype)), weights, idx


def route(logits: torch.Tensor, top_k: int, norm_topk: bool, mode: str, dtype: torch.dtype | None = None):
    """Router logits [T, E] -> (routing weights [T, k], expert ids [T, k]): fp32 softmax, top-k, optional
    renormalisation, cast to ``dtype`` for "hf" (default the logits'; fp32 logits holding model-dtype values
    give the softmax its input without a cast). ``minite.kernels.route``: one fused pass on CUDA, bitwise
    torch's ops (the trainer's), which run on CPU."""
    return kernels.route(logits, top_k, norm_topk, mode, dtype)


def moe(x: torch.Tensor, experts: Experts, weights: torch.Tensor, idx: torch.Tensor, recipe: EngineRecipe,
        calib: Calibrator | None = None, valid: torch.Tensor | None = None,
        codes: nvfp4.NVFP4Tensor | None = None, deferred_shape: tuple | None = None):
    """Routed experts for tokens x [T, H]: rows sorted by expert, two grouped GEMMs, weighted k-sum. The
    sort and the expert offsets stay on the device (bincount would read its size back). ``codes``: x's codes
    (``rms_norm_for_linears``), which the gate_up GEMM reads. ``deferred_shape``: the k-sum is not taken
    here; the result is ``fused_ops.RoutedRows`` of that shape, for the next norm to take in its pass
    (``value()`` for any other reader)."""
    perm, rows, offsets, inv = fused_ops.sort_by_expert(idx, experts.num_experts, inverse=True)  # stable, by expert
    vrows = None if valid is None else valid[rows]
    stacked = experts.stacked if calib is None else {}
    h = grouped_linear(x, stacked.get("gate_up", experts.gate_up), offsets, recipe, experts.gate_up_amax,
                       f"{experts.name}.gate_up", calib, vrows, lambda: experts.dequantized("gate_up"),
                       experts.act_scale.get("gate_up"), rows=rows, codes=codes)
    y = grouped_linear(h, stacked.get("down", experts.down), offsets, recipe, experts.down_amax,
                       f"{experts.name}.down", calib, vrows, lambda: experts.dequantized("down"),
                       experts.act_scale.get("down"), silu_mode=recipe.non_gemm)  # input SiLU(gate) * up
    # back to (token, k) order, weighted and summed over k (transformers' grouped_mm experts for "hf")
    if deferred_shape is not None and y.dtype == x.dtype:
        return fused_ops.RoutedRows(y, perm, inv, weights, recipe.non_gemm, tuple(deferred_shape))
    out = fused_ops.combine_experts(y, perm, weights, recipe.non_gemm, inv=inv).to(x.dtype)
    return out if deferred_shape is None else out.view(deferred_shape)


def value(x):
    """A tensor, or a ``fused_ops.RoutedRows``'s combine."""
    return x.value() if isinstance(x, fused_ops.RoutedRows) else x


# ------------------------------------------------------------------------------------------------ attention
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     seq_lens: torch.Tensor, scaling: float, numerics: str) -> torch.Tensor:
    """One new query per sequence against its cache row. q [B, Hq, D]; k_cache / v_cache [slots, Hkv, S, D]
    (one layer of the KV cache); slot_ids [B] int32: the sequence's cache row; seq_lens [B] int32 (>= 1):
    keys 0 .. seq_len - 1 are attended. Returns [B, Hq, D] in q's dtype. ``numerics``: "fast" (the sdpa
    arms: bf16 dots, fp32 softmax) or "invariant" (float64 throughout: the bits of ``invariant_attention``
    at that position). ``minite.kernels.decode_attention``: the CUDA / Triton kernels on the GPU (GQA without
    copies of the cache, no host sync, fixed grid per batch size), its PyTorch reference on CPU."""
    if numerics not in ATTENTION_NUMERICS:
        raise ValueError(f"attention numerics {numerics!r}: expected one of {ATTENTION_NUMERICS}")
    # the step's rows and lengths are the sampler's own (in range by construction): no read back to check them
    return kernels.decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scaling, numerics=numerics,
                                    check_values=False)


# ------------------------------------------------------------------------------------------------ sampling
def sample_tokens_with_max(logits: torch.Tensor, temperature, top_p, uniform: torch.Tensor):
    """logits [B, V] (fp32 or the model's dtype) -> (token ids [B], each row's max of the logits, fp32 [B],
    exact) from one read, the inverse CDF at each row's draw ``uniform`` [B], nothing read back to the host
    (``minite.kernels.sample_tokens_with_max``: Triton kernels on CUDA without top_p, else the PyTorch
    reference). ``temperature`` (> 0) and ``top_p`` (None = 1): numbers or 0-dim device tensors."""
    return kernels.sample_tokens_with_max(logits, temperature, uniform, top_p)


def sample_tokens_with_log_softmax(logits: torch.Tensor, temperature, uniform: torch.Tensor):
    """(token ids [B], the logits' log-softmax: ``kernels.log_softmax_rows``'s result) without top_p, the values
    of ``sample_tokens_with_max`` and that call; on CUDA the token's pick and the log-softmax's sums share one
    launch (``minite.kernels.sample_tokens_with_log_softmax``)."""
    return kernels.sample_tokens_with_log_softmax(logits, temperature, uniform)
