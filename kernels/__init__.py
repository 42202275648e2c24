"""minite.kernels: NVFP4 (W4A4) kernels and the rollout path's attention and BF16 GEMM — Triton on the GPU,
exact pure PyTorch on CPU.

    quantize(x, formula="te", tile=(1, 16), scaling="tensor", amax=None, global_encode_scale=None,
             rounding="nearest", rht=False, generator=None, check=True, backend=None) -> NVFP4Tensor
        minite.nvfp4.quantize, bit for bit; fused Triton kernels for formulas "te" and "vllm" (else the reference).
    quantize_dequantize(x, out_dtype=torch.bfloat16, ...same...) -> [M, K]
        dequantize(quantize(x, ...)).to(out_dtype), bit for bit, written by the cast pass itself.
    quantize_silu_mul(gate, up, mode, formula="te", tile=(1, 16), scaling="tensor", ...) -> NVFP4Tensor
        quantize(fused_ops.silu_mul(gate, up, mode), ...), bit for bit, SiLU * up computed inside the cast pass.
    quantize_rms_norm(x, weight, eps, mode, residual=None, ..., f16=False) -> (y, [residual + x,] NVFP4Tensor)
        fused_ops.rms_norm(...) and the quantize of its output, bit for bit; the norm's last pass is the cast.
        f16: that pass also writes the codes' fp16 GEMM form (a ``DecodedNVFP4Tensor``) for a GEMM that reads
        tokens so (``reads_f16_tokens(w, m)``), which then skips its own decode pass.
    quantize_weight_groups(w, groups, tile=(16, 16)) -> codes, scales, S_dec [groups], BF16 values
        formula "te", one tensor amax per row group (experts x shards); amax pass + one cast pass.
    (quantize and quantize_dequantize take x as any strided view, plus width= / gather= for the wgrad
    operands: tokens as the block dimension, zero-padded or gathered per expert, without copies; check=False
    skips the host reads: the NaN/Inf check and the range check of gather.)
    dequantize(t, out_dtype=torch.float32, backend=None) -> [M, K]
        minite.nvfp4.dequantize(t).to(out_dtype), bit for bit, one Triton pass on the GPU.
    nvfp4_gemm(a, w, out_dtype=torch.bfloat16, bias=None, backend=None) -> [M, N]
        a @ w.T for NVFP4Tensors a [M, K], w [N, K]; batch invariant and deterministic.
    prepare_weight(w) -> PreparedWeight   one-time fp16 re-layout for large-M speed (4x the packed bytes);
        also read at 17-64 decode rows by wide weights (``gemm.F16_DECODE_MIN_M``).
        ``dense_weight_bytes(w, m)``: what a call of m rows reads.
    prepare_experts(ws) -> NVFP4Experts   stacked + pre-decoded fp16 experts (fast large-M grouped path).
    decode_layout(w or ws) -> PreparedWeight / NVFP4Experts   the codes also in the CUDA decode kernel's
        fragment order (a sampler's decode-time weights: one contiguous read per warp step; same bits).
    grouped_nvfp4_gemm(a, ws, offsets, out_dtype=torch.bfloat16, backend=None, k_segments=1) -> [M, N]
        MoE: rows sorted by expert, ws a list of NVFP4Tensors or an NVFP4Experts (``stack_experts``).
    transpose_weight(w) / transpose_experts(ex, shards=1)
        a 16x16-tiled weight as W^T in 1x16 blocks (same codes and scales): dgrad's NVFP4 weight operand.
    wgrad_grouped_nvfp4_gemm(a, b, ends, out_dtype=torch.bfloat16, backend=None) -> [E, M, N]
        MoE wgrad: out[e] = a[:, seg_e] @ b[:, seg_e].T over each expert's token segment, one launch.
    decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scaling, numerics="fast", splits=None,
                     backend=None) -> [B, Hq, D]
        one decode step over a [slots, Hkv, S, D] KV cache, GQA without copies, CUDA-graph safe; "fast" (bf16
        dots, fp32 softmax) or "invariant" (float64: the bits of invariant_attention at that position).
    invariant_attention(query, key, value, scaling, keep=None, causal=True, backend=None) -> [B, Tq, Hq, D]
        float64 attention, flash style (no [Tq, Tk] buffer); bitwise its PyTorch reference.
    invariant_gemm(x, w, bias=None, backend=None) -> [M, N]
        batch-invariant BF16 x @ w.T: fp32 accumulation in one fixed K order for every M (exact float64 on CPU).
    invariant_gemm_parts(x, w, backend=None) -> [S, M, N] | None; sum_parts(parts, dtype, out_dtype=None)
        its split-K partial sums where it splits K (the router), and their sum pass (the same bits).
    sample_tokens(logits, temperature, uniform, top_p=None, backend=None) -> [B]
        inverse-CDF sampling, one draw per row, CUDA-graph safe; two Triton passes without top_p.
    sample_tokens_with_max(logits, temperature, uniform, top_p=None, backend=None) -> ([B], [B] fp32)
        the same, and each row's max of the logits from the same read.
    sample_tokens_with_log_softmax(logits, temperature, uniform, backend=None) -> ([B], log_softmax_rows(logits))
        both at once, the same values; on CUDA the pick and the log-softmax's sums share one launch, and the
        statistics come as ``LogSoftmaxParts`` (before their last pass, which record_tokens takes).
    log_softmax_rows(logits, backend=None, row_max=None) -> [B, V] | LogSoftmaxRows(logits, mx, logsum)
        torch.log_softmax(logits, -1), or (where its order is reproduced) just each row's max and log-sum;
        a given row max saves the statistics one read of the logits.
    route(logits, top_k, norm_topk, mode, dtype=None, backend=None) -> (weights [T, k], ids [T, k])
        MoE routing (fp32 softmax, top-k, renormalisation, cast) in one pass, bitwise torch's CUDA ops.
    route_parts(parts, logits_dtype, top_k, norm_topk, mode, dtype=None, backend=None)
        the same from the router GEMM's split-K partial sums (``invariant_gemm_parts``), added in the pass.
    record_tokens(tok, logp, slots, nxt, end, tokens, logprobs, stopped, stop, trash, write_tokens, ...)
        the decode step's token / log-prob / stop bookkeeping in one launch.
    step_inputs(pos, slots, tokens, uniform, max_pos) -> StepInputs(slot_ids, seq_lens, nxt, forced, draw)
        the decode step's per-row inputs (int32 ids / lengths, next position, its table cells) in one launch.
    fused_ops: the decode step's non-GEMM ops (RMSNorm with its residual add, q/k norm + rotary + KV-cache
        write, SiLU * up, the expert sort and the experts' weighted sum), each bitwise its op-by-op reference.
backend: None/"auto" (MINITE_KERNELS_BACKEND, else Triton for CUDA tensors and PyTorch for CPU ones),
"triton" (CPU tensors under TRITON_INTERPRET=1), "torch". Two CUDA kernels, built on first use with nvcc
(``_cuda_build``; MINITE_KERNELS_CUDA=0 turns them off), take over where they apply under "auto", with the
same bits: the decode-regime NVFP4 GEMM (``decode_gemm.cu``) and the float64 decode attention on the fp64
tensor cores (``decode_attention.cu``). Notes and measurements: docs/KERNELS_NOTES.md.
"""
if __name__ == "kernels":
    # This directory is minite.kernels. It is imported as a top-level "kernels" only when the repository root is
    # on sys.path (``python -m ...`` run from the root puts it first), where that name is Hugging Face's
    # package, which transformers imports (and requires from 5.25 on): load that package in this one's place.
    # Where it is not installed, stand in as an empty namespace package (no file, no version: what
    # transformers, probing for the package by importing it, counts as absent).
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        _spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _spec.submodule_search_locations = []
    _hf = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _hf
    if _spec.loader is not None:
        _spec.loader.exec_module(_hf)
else:
    from .gemm import dense_weight_bytes, grouped_nvfp4_gemm, nvfp4_gemm, reads_f16_tokens
    from .weights import (DecodedNVFP4Tensor, NVFP4Experts, PreparedWeight, decode_layout, gemm_path, prepare_experts,
                          prepare_weight, stack_experts)
    from .backward_gemm import transpose_experts, transpose_weight, wgrad_grouped_nvfp4_gemm
    from .quantize import (dequantize, quantize, quantize_dequantize, quantize_rms_norm, quantize_silu_mul,
                           quantize_weight_groups)
    from .attention import decode_attention, invariant_attention
    from .hp_gemm import invariant_gemm, invariant_gemm_parts, sum_parts
    from .sampling import (StepInputs, record_tokens, sample_tokens, sample_tokens_with_log_softmax,
                           sample_tokens_with_max, step_inputs)
    from .routing import route, route_parts
    from .log_softmax import LogSoftmaxParts, LogSoftmaxRows, log_softmax_rows
    from . import fused_ops

    __all__ = ["quantize", "quantize_dequantize", "quantize_rms_norm", "quantize_silu_mul", "quantize_weight_groups",
               "dequantize", "nvfp4_gemm", "dense_weight_bytes", "reads_f16_tokens", "DecodedNVFP4Tensor",
               "grouped_nvfp4_gemm", "prepare_weight", "PreparedWeight", "NVFP4Experts", "stack_experts",
               "prepare_experts", "decode_layout", "gemm_path", "transpose_weight", "transpose_experts",
               "wgrad_grouped_nvfp4_gemm", "decode_attention", "invariant_attention", "invariant_gemm",
               "invariant_gemm_parts", "sum_parts", "route_parts",
               "sample_tokens", "sample_tokens_with_max", "sample_tokens_with_log_softmax", "record_tokens",
               "step_inputs", "StepInputs", "route",
               "log_softmax_rows", "LogSoftmaxRows", "LogSoftmaxParts", "fused_ops"]
