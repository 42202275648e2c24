"""The forward NVFP4 linear both engines call: quantize the activation per recipe, then one GEMM path.

GEMM paths (``EngineRecipe.gemm``):
    "emulated"  what TE on Hopper and vLLM's NVFP4 emulation do without FP4 tensor cores: dequantize both
                operands to BF16, then a BF16 matmul (cuBLAS on GPU). Its reduction order depends on M.
    "kernel"    minite's W4A4 kernel (``minite.kernels.nvfp4_gemm``): exact block products, fp32 accumulate,
                one fixed K order — batch-invariant, so trainer (M = tokens) and sampler (M = the decode
                batch's rows per step) get bitwise-identical rows. On CPU it is an exact float64-accumulation path.
    "bf16"      plain BF16 matmul (no quantization).
(The trainer's "te" path lives in ``minite.engines.te_backend`` and needs Transformer Engine.)

Activations are always 2D-flattened [tokens, K] and quantized in 1x16 blocks along K.
"""
from __future__ import annotations

import torch

from minite import kernels, nvfp4
from minite.engines.arms import QuantSpec


def _static_kwargs(spec: QuantSpec, static_scale: torch.Tensor | float | None) -> dict:
    """The quantizer arguments of an activation spec, with its static scale where it has one."""
    kw = spec.quantize_kwargs()
    if spec.scaling == "static":
        if static_scale is None:
            raise ValueError("static activation scaling needs a calibrated scale; run calibration first")
        kw["global_encode_scale" if spec.formula == "vllm" else "amax"] = static_scale
    return kw


def quantize_activation(x2d: torch.Tensor, spec: QuantSpec, static_scale: torch.Tensor | None = None,
                        check: bool = False) -> nvfp4.NVFP4Tensor:
    """Quantize [tokens, K] activations. ``static_scale``: the calibrated amax ("te"/"modelopt") or vLLM's
    encode scale G ("vllm") when ``spec.scaling == "static"``. Triton on CUDA ("te", "vllm"), else
    minite.nvfp4."""
    return kernels.quantize(x2d, check=check, **_static_kwargs(spec, static_scale))


def quantize_activation_silu_mul(gate: torch.Tensor, up: torch.Tensor, mode: str, spec: QuantSpec,
                                 static_scale: torch.Tensor | None = None) -> nvfp4.NVFP4Tensor:
    """``quantize_activation(fused_ops.silu_mul(gate, up, mode), spec, static_scale)`` bit for bit, the SiLU *
    up computed inside the cast pass on CUDA (``kernels.quantize_silu_mul``): the expert down projection's
    input without its [rows, I] intermediate."""
    return kernels.quantize_silu_mul(gate, up, mode, check=False, **_static_kwargs(spec, static_scale))


def quantize_activation_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str, spec: QuantSpec,
                                 static_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                                 f16: bool = False) -> tuple:
    """(y, codes) or (y, residual + x, codes): ``fused_ops.rms_norm`` and ``quantize_activation`` of its output
    (as [tokens, K]) bit for bit, the norm's last pass being the cast on CUDA (``kernels.quantize_rms_norm``):
    a norm whose next linear is NVFP4, one launch less. ``f16``: the codes also in the fp16 form the next
    GEMM reads (``kernels.reads_f16_tokens``), written by that pass."""
    return kernels.quantize_rms_norm(x, weight, eps, mode, residual, check=False, f16=f16,
                                     **_static_kwargs(spec, static_scale))


def qdq_activation(x2d: torch.Tensor, spec: QuantSpec, static_scale: torch.Tensor | float | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values the emulated GEMM multiplies: ``nvfp4.dequantize(quantize_activation(...)).to(out_dtype)``
    bit for bit, written by the cast pass itself (one launch on CUDA instead of a cast and a multi-pass
    dequantize)."""
    return kernels.quantize_dequantize(x2d, out_dtype, check=False, **_static_kwargs(spec, static_scale))


def nvfp4_gemm(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, gemm: str, out_dtype: torch.dtype = torch.bfloat16
               ) -> torch.Tensor:
    """a @ w.T on the chosen path."""
    if gemm == "emulated":
        return torch.matmul(nvfp4.dequantize(a).to(torch.bfloat16), nvfp4.dequantize(w).to(torch.bfloat16).T
                            ).to(out_dtype)
    if gemm == "kernel":
        return kernels.nvfp4_gemm(a, w, out_dtype=out_dtype)
    raise ValueError(f"unknown NVFP4 GEMM path {gemm!r} (emulated | kernel)")


def nvfp4_linear(x: torch.Tensor, w: nvfp4.NVFP4Tensor, act: QuantSpec, gemm: str,
                 static_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 codes: nvfp4.NVFP4Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [..., K] with an already-quantized weight [N, K]; returns x.dtype.
    ``codes``: x [tokens, K] already quantized as ``act`` says (by the pass that made x), used as they are."""
    lead, k = x.shape[:-1], x.shape[-1]
    a = codes if codes is not None else quantize_activation(x.reshape(-1, k), act, static_scale)
    if bias is None:  # the epilogue rounds its fp32 result to x.dtype: the bits of .to(x.dtype), one launch less
        return nvfp4_gemm(a, w, gemm, out_dtype=x.dtype).reshape(*lead, w.shape[0])
    y = nvfp4_gemm(a, w, gemm, out_dtype=torch.float32) + bias.float()
    return y.to(x.dtype).reshape(*lead, w.shape[0])


def _runs_invariant(invariant: bool) -> bool:
    """Whether ``hp_linear`` runs the batch-invariant GEMM: asked for, and no autograd graph being built."""
    return invariant and not torch.is_grad_enabled()


def hp_linear_parts(x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor | None:
    """``hp_linear(x, weight, invariant)``'s split-K partial sums [S, M, N] (fp32) where it runs the invariant
    GEMM and that splits K (the router's narrow N), else None. ``kernels.sum_parts(parts, x.dtype)`` is then
    its output, and the routing kernel adds them itself (``kernels.route_parts``). x [M, K]."""
    return kernels.invariant_gemm_parts(x, weight) if _runs_invariant(invariant) else None


def hp_linear(x: torch.Tensor, weight: torch.Tensor, invariant: bool, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A high-precision (BF16) linear: router, lm_head, and every linear of a BF16 engine.

    ``invariant``: on log-prob paths (no autograd graph being built: the trainer's teacher-forced recompute,
    every sampler forward) a row's bits must not depend on how many rows share the call (cuBLAS picks
    different kernels and split-K for M = 1 and M = 16384). ``minite.kernels.invariant_gemm`` does that:
    on CUDA a Triton GEMM with BF16 products accumulated in fp32 in one fixed K order for every M (then one
    rounding); on CPU (and for dtypes other than bf16/fp16) exact float64 accumulation. Both engines call
    this function, so trainer and sampler rows stay bitwise equal on a device; the GPU numerics of the
    aligned arm's router / lm_head are therefore fixed-order fp32 (they were float64-accumulated before).
    With autograd on (the learner update) it stays a cuBLAS BF16 GEMM: that path only feeds gradients.
    ``out_dtype`` float32: the same x-dtype values, stored wider (the invariant GEMM writes them so, with no
    cast pass after it: the router's logits before their fp32 softmax).
    """
    if _runs_invariant(invariant):
        lead, k = x.shape[:-1], x.shape[-1]
        y = kernels.invariant_gemm(x.reshape(-1, k), weight, bias, out_dtype=out_dtype)
        return y.reshape(*lead, weight.shape[0])
    y = torch.nn.functional.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)
