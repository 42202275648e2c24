"""MoE experts for the trainer, plugged into transformers' own ``ExpertsInterface``.

HF's ``Qwen3MoeExperts`` holds 3D parameters ``gate_up_proj`` [E, 2I, H] (gate rows first, then up) and
``down_proj`` [E, H, I]; its forward dispatches on ``config._experts_implementation``. We register
``"minite_nvfp4"`` there (as transformers registers ``grouped_mm``) — no monkeypatching. Per module:
an experts module carrying a ``minite_quant`` (``ExpertsQuant``) runs NVFP4; one without (a BF16 arm, or a
layer the arm keeps in high precision) runs transformers' own ``grouped_mm`` forward.

NVFP4 path: tokens sorted by expert; the activations of all experts are quantized in one call (per-row or
per-tensor amax per the arm); the grouped GEMM is ``minite.kernels.grouped_nvfp4_gemm`` on gemm "kernel"
(its exact PyTorch path on CPU) or, on gemm "emulated", dequantize + one BF16 ``torch._grouped_mm``. gate_up's
gate and up halves keep separate global scales when ``fused_shards: per_shard`` (one NVFP4 tensor per expert
with a per-row global scale [2I]).
Backward: TE's treatment as in ``quant_linear`` — dgrad with SR-quantized dy against the quantized W,
wgrad per expert with both operands quantized along tokens (RHT), expert segments zero-padded (the quantizer
gathers each padded segment from the sorted rows itself: no padded copies). On gemm "kernel" both run on the
NVFP4 operands: dgrad as a grouped GEMM over the transposed experts (gate and up as two K segments when they
keep their own scales), wgrad as one token-grouped launch over the segments
(``minite.kernels.wgrad_grouped_nvfp4_gemm``); on "emulated", BF16 ``torch._grouped_mm`` on the dequantized
values. Either way the segments are padded to 16 tokens (whole NVFP4 blocks).
"""
from __future__ import annotations

import torch

from minite.engines import quant_linear as Q
from minite.kernels.backward_gemm import SEGMENT_ALIGN

EXPERTS_NAME = "minite_nvfp4"


def _experts_interface():
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    except ImportError as e:  # transformers < 5: experts were per-expert nn.Linear modules
        raise RuntimeError("minite needs transformers >= 5 with transformers.integrations.moe.ExpertsInterface "
                           f"(Qwen3-MoE experts as 3D parameters); import failed: {e}") from None
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        raise RuntimeError("transformers' ExpertsInterface has no 'grouped_mm' implementation; "
                           "this transformers version is not supported (tested: 5.17, 5.24)")
    return ExpertsInterface, ALL_EXPERTS_FUNCTIONS


def register_experts() -> str:
    """Register minite's experts forward (idempotent); returns the ``_experts_implementation`` name."""
    iface, _ = _experts_interface()
    iface.register(EXPERTS_NAME, minite_experts_forward)
    return EXPERTS_NAME


class ExpertsQuant:
    """Attached to an HF experts module as ``minite_quant``: the shared QuantState and one weight cache
    per 3D parameter (gate_up as two shards)."""

    def __init__(self, state: Q.QuantState):
        self.state = state
        self.gate_up = Q.WeightCache(state, state.recipe.weights, shards=2)
        self.down = Q.WeightCache(state, state.recipe.weights, shards=1)


# ------------------------------------------------------------------------------------------ grouped GEMMs
def bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [S, K] (rows sorted by expert) @ w[e] ([E, K, N]) per group; ``ends`` int32 [E] cumulative."""
    if hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and x.shape[0] > 0:
        return torch._grouped_mm(x, w, offs=ends)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def grouped_nvfp4(a, qw: Q.QWeight, offsets: torch.Tensor, out_dtype) -> torch.Tensor:
    """The one call site of the grouped W4A4 kernel (minite.kernels: one GEMM launch for all experts; exact
    PyTorch path on CPU)."""
    return Q._kernels.grouped_nvfp4_gemm(a, qw.experts(), offsets, out_dtype=out_dtype)


def _grouped_forward(x, qw: Q.QWeight, offsets, state: Q.QuantState):
    if state.gemm == "emulated":
        a = Q.qdq_act(x, state)
        with state.timed("gemm"):
            return bf16_grouped_mm(a, qw.dq.transpose(-2, -1), offsets[1:]).to(x.dtype)
    a = Q.quantize_act(x, state)
    with state.timed("gemm"):
        return grouped_nvfp4(a, qw, offsets, out_dtype=x.dtype)  # rounded from fp32 in the epilogue, as the sampler


def _padded_layout(offsets: torch.Tensor, rows: int, align: int = 16, fill: bool = True,
                   interpreted: bool = False):
    """The wgrad operands' token layout, computed on the device (no host sync; ``rows`` = the sorted rows'
    count, known from the shapes): every expert's token segment zero-padded to a multiple of ``align``, within
    a static width ``ceil(rows) + align * E`` (>= the padded total). ``fill`` (for torch._grouped_mm): an expert
    without tokens gets one block of ``align`` zero tokens (no group is empty: its dW is a product of zeros,
    exactly 0), and the width's slack is appended to the last segment as zero tokens (zero products leave its
    sums as they are); else (the NVFP4 kernel) empty segments stay empty and the slack is past the last end.
    One Triton launch on the GPU (``minite.kernels._triton_schedule``; ``interpreted``: under the interpreter on
    CPU, for tests), PyTorch ops elsewhere.
    Returns, for each padded position, the source row (-1 = a zero token; the quantizer's ``gather``) and the
    padded segment ends (int32 [E])."""
    if offsets.device.type != "cuda" and not interpreted:
        return _padded_layout_torch(offsets, rows, align, fill)
    import triton

    from minite.kernels import _triton_schedule as ts
    e = offsets.numel() - 1
    width = (rows + align - 1) // align * align + align * e
    src = torch.empty(width, dtype=torch.int32, device=offsets.device)
    pends = torch.empty(e, dtype=torch.int32, device=offsets.device)
    bp = 64
    ts.padded_layout_kernel[(triton.cdiv(width, bp),)](offsets, src, pends, e, width, ALIGN=align, FILL=fill,
                                                       BE=max(16, triton.next_power_of_2(e)), BP=bp)
    return src, pends


def _padded_layout_torch(offsets: torch.Tensor, rows: int, align: int = 16, fill: bool = True):
    """``_padded_layout`` in PyTorch ops (its reference, and the CPU path)."""
    e = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    pcounts = (counts + align - 1) // align * align
    if fill:
        pcounts = pcounts.clamp_min(align)
    pends = torch.cumsum(pcounts, 0)
    pstart = pends - pcounts
    width = (rows + align - 1) // align * align + align * e
    row = torch.arange(rows, device=offsets.device)
    seg = torch.searchsorted(offsets[1:].contiguous(), row.to(offsets.dtype), right=True)
    src = torch.full((width,), -1, dtype=torch.int32, device=offsets.device)
    src[pstart[seg] + row - offsets[:-1][seg]] = row.to(torch.int32)
    if fill:
        pends = torch.cat([pends[:-1], pends.new_full((1,), width)])   # a device fill: no host-to-device copy
    return src, pends.to(torch.int32)


def _wgrad_grouped(dyt, xt, pends, w_dq) -> torch.Tensor:
    """dW[e] = dyt[:, seg_e] @ xt[:, seg_e]^T over the padded token segments (none empty) -> [E, N, K]."""
    if hasattr(torch, "_grouped_mm") and dyt.dtype == torch.bfloat16:
        return torch._grouped_mm(dyt, xt.t(), offs=pends).to(w_dq.dtype)
    dw = w_dq.new_zeros(w_dq.shape)
    start = 0
    for e, end in enumerate(pends.tolist()):
        dw[e] = dyt[:, start:end] @ xt[:, start:end].T
        start = end
    return dw


class _GroupedNVFP4Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, qw: Q.QWeight, offsets, state):
        ctx.state, ctx.qw = state, qw
        ctx.save_for_backward(x, offsets)
        return _grouped_forward(x, qw, offsets, state)

    @staticmethod
    def backward(ctx, dy):
        x, offsets = ctx.saved_tensors
        st, qw = ctx.state, ctx.qw
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dy [S, N] @ W_e [N, K]
            if Q.dgrad_on_codes(st, qw, dy):
                dx = Q.dgrad_nvfp4(dy, qw, st, x.dtype, offsets)
            else:
                dyq = Q.qdq_grad(dy, st, st.recipe.backward_rounding)
                with st.timed("gemm"):
                    dx = bf16_grouped_mm(dyq, qw.dq, offsets[1:]).to(x.dtype)
        if ctx.needs_input_grad[1]:  # dW_e = dy_e^T x_e, reduction over the expert's tokens
            native = st.gemm == "kernel"
            src, pends = _padded_layout(offsets, x.shape[0], SEGMENT_ALIGN, fill=not native)
            dyt, xt = Q.wgrad_operands(dy, x, st, dequantized=not native, gather=src)
            with st.timed("gemm"):
                if native:
                    dw = Q._kernels.wgrad_grouped_nvfp4_gemm(dyt, xt, pends, out_dtype=qw.dq.dtype)
                else:
                    dw = _wgrad_grouped(dyt, xt, pends, qw.dq)
        return dx, dw, None, None, None


def minite_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """ExpertsInterface implementation (same signature and result layout as transformers' grouped_mm)."""
    q: ExpertsQuant | None = getattr(self, "minite_quant", None)
    if q is None:
        _, fns = _experts_interface()
        return fns["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)
    if not getattr(self, "has_gate", True) or getattr(self, "is_transposed", False) \
            or getattr(self, "has_bias", False) or getattr(self, "_is_expert_parallel", False):
        raise RuntimeError("minite_nvfp4 experts support Qwen3-MoE's layout only (gated, [E, N, K], no bias, "
                           "no expert parallelism)")
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(expert_ids, stable=True)
    x = hidden_states[perm // top_k]
    # each expert's first sorted row, then S, found on the device (bincount would read its size back)
    bounds = torch.arange(self.num_experts + 1, device=x.device, dtype=ids_sorted.dtype)
    offsets = torch.searchsorted(ids_sorted, bounds).to(torch.int32)
    st = q.state
    h = _GroupedNVFP4Fn.apply(x, self.gate_up_proj, q.gate_up.get(self.gate_up_proj), offsets, st)
    h = self._apply_gate(h)
    out = _GroupedNVFP4Fn.apply(h, self.down_proj, q.down.get(self.down_proj), offsets, st)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv].view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
