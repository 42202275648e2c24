"""minite.kernels: NVFP4 (W4A4) kernels — Triton on the GPU, exact pure PyTorch on CPU.

    quantize(x, formula="te", tile=(1, 16), scaling="tensor", amax=None, global_encode_scale=None,
             rounding="nearest", rht=False, generator=None, check=True, backend=None) -> NVFP4Tensor
        minite.nvfp4.quantize, bit for bit; fused Triton kernel for formula "te" 1x16 (else the reference).
    quantize_dequantize(x, out_dtype=torch.bfloat16, ...same...) -> [M, K]
        dequantize(quantize(x, ...)).to(out_dtype), bit for bit, written by the cast pass itself.
    quantize_weight_groups(w, groups, tile=(16, 16)) -> codes, scales, S_dec [groups], BF16 values
        formula "te", one tensor amax per row group (experts x shards); amax pass + one cast pass.
    (quantize and quantize_dequantize take x as any strided view, plus width= / gather= for the wgrad
    operands: tokens as the block dimension, zero-padded or gathered per expert, without copies.)
    dequantize(t, out_dtype=torch.float32, backend=None) -> [M, K]
        minite.nvfp4.dequantize(t).to(out_dtype), bit for bit, one Triton pass on the GPU.
    nvfp4_gemm(a, w, out_dtype=torch.bfloat16, bias=None, backend=None) -> [M, N]
        a @ w.T for NVFP4Tensors a [M, K], w [N, K]; batch invariant and deterministic.
    prepare_weight(w) -> PreparedWeight   one-time fp16 re-layout for large-M speed (4x the packed bytes).
    prepare_experts(ws) -> NVFP4Experts   stacked + pre-decoded fp16 experts (fast large-M grouped path).
    grouped_nvfp4_gemm(a, ws, offsets, out_dtype=torch.bfloat16, backend=None) -> [M, N]
        MoE: rows sorted by expert, ws a list of NVFP4Tensors or an NVFP4Experts (``stack_experts``).
backend: None/"auto" (MINITE_KERNELS_BACKEND, else Triton for CUDA tensors and PyTorch for CPU ones),
"triton" (CPU tensors under TRITON_INTERPRET=1), "torch". Notes and measurements: docs/KERNELS_NOTES.md.
"""
from .gemm import grouped_nvfp4_gemm, nvfp4_gemm
from .weights import NVFP4Experts, PreparedWeight, gemm_path, prepare_experts, prepare_weight, stack_experts
from .quantize import dequantize, quantize, quantize_dequantize, quantize_weight_groups

__all__ = ["quantize", "quantize_dequantize", "quantize_weight_groups", "dequantize", "nvfp4_gemm", "grouped_nvfp4_gemm", "prepare_weight", "PreparedWeight",
           "NVFP4Experts", "stack_experts", "prepare_experts", "gemm_path"]
