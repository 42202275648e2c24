"""The backward pass on NVFP4 operands (Transformer Engine's NVFP4 recipe, with its GEMMs run on the codes).

    dgrad  dx = dy W      dy quantized 1x16 along N. W's 16x16 tiles make W^T a valid 1x16-block tensor with
                          the same codes and scales (``transpose_tiled``): dx = nvfp4_gemm(dy_q, W^T), grouped
                          for MoE experts (grouped_nvfp4_gemm over the transposed experts).
    wgrad  dW = dy^T x    both operands quantized 1x16 along tokens: dW = nvfp4_gemm(dyT_q, xT_q); for MoE
                          experts each expert reduces over its own token segment: ``wgrad_grouped_nvfp4_gemm``,
                          one launch over (output tile, expert), segment bounds read on the device (no sync).

Same contract as the forward kernels: every product exact (E2M1 x E4M3 values are exact in fp16), fp32
accumulation in one fixed order (a segment's tokens in order, 128 at a time), global scales in the epilogue;
the CPU path is exact (float64). A global scale per row of W lies along dgrad's reduction dimension and has no
place in the epilogue: fused pieces of W with a scale each (gate/up) become K segments of W^T, each summed from
zero and added times its scale (grouped_nvfp4_gemm's ``k_segments``).
"""
from __future__ import annotations

import torch

from minite.nvfp4 import NVFP4Tensor

from . import _torch_gemm
from .weights import NVFP4Experts, _check_tensor, _u8, gemm_path

SEGMENT_ALIGN = 16  # wgrad token segments start and end on whole 16-blocks (each block in one segment)
# GPU tile config of the token-grouped launch (fp16 operands): the best of an H200 sweep at the Qwen3-30B-A3B
# experts (4096 tokens x top-8 over 128 experts: 2-4 K steps a tile; stages 3 vs 4: 970 vs 1175 us for gate_up)
WGRAD_CONFIG = dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=3)
WGRAD_INTERPRET = dict(BM=32, BN=32, GROUP_M=4, num_warps=4, num_stages=1)


def transpose_tiled(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., N, K/2] and e4m3 scales [..., N, K/16] of 16x16-tiled blocks -> the same values as [..., K, N]
    in 1x16 blocks along N: codes [..., K, N/2], scales [..., K, N/16] (each tile's scale repeated on its 16
    rows). Exact: a tile's 256 values share one scale, so transposing moves codes only."""
    *lead, n, kh = codes.shape
    k = 2 * kh
    if n % 16:
        raise ValueError(f"16x16 tiles need N % 16 == 0, got N = {n}")
    pairs = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(*lead, n // 2, 2, k)  # rows 2i, 2i+1
    codes_t = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).transpose(-1, -2).contiguous()  # pack along N, then move
    tile = _u8(scales).reshape(*lead, n // 16, 16, k // 16)[..., 0, :]          # [..., N/16, K/16]
    scales_t = tile.transpose(-1, -2).repeat_interleave(16, dim=-2).contiguous()  # [..., K, N/16]
    return codes_t, scales_t.view(torch.float8_e4m3fn)


def transpose_weight(w: NVFP4Tensor) -> NVFP4Tensor:
    """W [N, K] in 16x16 tiles with one global scale -> W^T [K, N] in 1x16 blocks (dgrad's weight operand)."""
    _check_tensor(w, "w")
    if w.global_scale.dim():
        raise ValueError("transpose_weight: a per-row global scale of W lies along W^T's K; split the rows first")
    return NVFP4Tensor(*transpose_tiled(w.codes, w.scales), w.global_scale)


def transpose_experts(ex: NVFP4Experts, shards: int = 1) -> NVFP4Experts:
    """Stacked experts [E, N, K] in 16x16 tiles -> [E, K, N] in 1x16 blocks. ``shards`` S > 1: the experts'
    rows are S fused pieces, each with its own global scale (``ex.global_scale`` [E, N], constant on each
    piece); they become W^T's S K segments: global scale [E, S], for grouped_nvfp4_gemm(k_segments=S)."""
    e, n, _ = ex.shape
    g = ex.global_scale
    if shards > 1:
        if g.shape != (e, n) or n % (16 * shards):
            raise ValueError(f"{shards} shards need per-row global scales [{e}, {n}] and N % {16 * shards} == 0")
        g = g.view(e, shards, n // shards)[:, :, 0].contiguous()
    elif g.dim() != 1:
        raise ValueError("transpose_experts: per-row global scales lie along W^T's K; give shards= for fused pieces")
    return NVFP4Experts(*transpose_tiled(ex.codes, ex.scales), g)


# ----------------------------------------------------------------------------------- token-grouped wgrad
def _check_wgrad(a: NVFP4Tensor, b: NVFP4Tensor, ends: torch.Tensor, out_dtype) -> None:
    from .gemm import OUT_DTYPES
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    if a.shape[1] != b.shape[1] or a.device != b.device:
        raise ValueError(f"a {a.shape} on {a.device} and b {b.shape} on {b.device}: need the same tokens, device")
    if not isinstance(ends, torch.Tensor) or ends.dim() != 1 or ends.numel() < 1 \
            or ends.dtype not in (torch.int32, torch.int64):
        raise ValueError("ends must be an int32/int64 tensor [E] of segment ends")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if ends.device.type == "cpu":  # cheap here; on the GPU a check would cost a host sync per call
        e = ends.tolist()
        steps = zip([0] + e, e, strict=False)
        if any(x % SEGMENT_ALIGN for x in e) or any(x > y for x, y in steps) or e[-1] > a.shape[1]:
            raise ValueError(f"segment ends must be non-decreasing multiples of {SEGMENT_ALIGN} up to "
                             f"T = {a.shape[1]}: {e}")


def _torch_wgrad(a, b, ends, out_dtype) -> torch.Tensor:
    bounds = [0] + ends.tolist()
    m, n = a.shape[0], b.shape[0]
    out = torch.zeros(len(bounds) - 1, m, n, dtype=out_dtype, device=a.device)
    av, bv = _torch_gemm.block_values(a.codes, a.scales), _torch_gemm.block_values(b.codes, b.scales)
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        acc = _torch_gemm.exact_dot(av[:, lo:hi], bv[:, lo:hi]) if hi > lo else av.new_zeros(m, n)
        out[e] = _torch_gemm.epilogue(acc, a.row_global_scale(), b.row_global_scale(), None, out_dtype)
    return out


def decode_f16_segments(t: NVFP4Tensor, ends: torch.Tensor, write_ends: bool = True):
    """The pre-decoded fp16 form of a wgrad operand [R, T] whose token segments end at ``ends`` (int32 [E],
    multiples of 16): each segment decoded as ``decode_f16`` decodes it alone, starting on a 128-wide K step
    of its own -> (fp16 [R, KP], the segments' ends in that form (int32 [E], multiples of 128; None unless
    ``write_ends``)). So the token-grouped GEMM runs each segment's chain exactly as the dense kernel runs it
    over those columns, while the quantizer pads the segments to 16 tokens only, not to 128 (its static width
    for 32,768 routed tokens over 128 experts: 34,816 columns instead of 49,152). KP bounds the step-padded
    total for any routing (static: no host sync)."""
    import triton

    from . import _triton_gemm as tg
    r, k = t.shape
    e = ends.numel()
    kp = (k + (tg.BK - SEGMENT_ALIGN) * e + tg.BK - 1) // tg.BK * tg.BK
    out = torch.empty(r, kp, dtype=torch.float16, device=t.codes.device)
    step_ends = torch.empty(e, dtype=torch.int32, device=t.codes.device) if write_ends else None
    if r:
        br = 16 if t.codes.device.type == "cpu" else 64
        tg.decode_f16_segments_kernel[((r + br - 1) // br, kp // tg.BK)](
            t.codes.contiguous(), _u8(t.scales), ends, out, step_ends if write_ends else ends, r, k, kp, e,
            BR=br, BK=tg.BK, BE=max(16, triton.next_power_of_2(e)), WRITE_ENDS=write_ends, num_warps=4)
    elif write_ends:
        step_ends.zero_()
    return out, step_ends


def _triton_wgrad(a, b, ends, out_dtype) -> torch.Tensor:
    from . import _triton_gemm as tg
    m, n, e = a.shape[0], b.shape[0], ends.numel()
    out = torch.empty(e, m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    cfg = dict(WGRAD_INTERPRET if a.device.type == "cpu" else WGRAD_CONFIG)
    bm, bn, gm = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M")
    ga, gb = a.global_scale.contiguous(), b.global_scale.contiguous()
    ends32 = ends.to(torch.int32).contiguous()
    a16, step_ends = decode_f16_segments(a, ends32)
    b16, _ = decode_f16_segments(b, ends32, write_ends=False)
    tiles_m = (m + bm - 1) // bm
    grid = (tiles_m * ((n + bn - 1) // bn), e)
    tg.nvfp4_mm_kernel[grid](
        a16, _u8(a.scales), b16, _u8(b.scales), ga, gb, ga, out, ga, ga, step_ends,
        m, n, a16.shape[1], tiles_m, 0, 0, 0,
        GA_ROW=ga.dim() == 1, GW_ROW=gb.dim() == 1, HAS_BIAS=False, GROUPED=False,
        BM=bm, BN=bn, BK=tg.BK, GROUP_M=gm, A_F16=True, W_F16=True, KC=0, K_GROUPED=True, **cfg)
    return out


def wgrad_grouped_nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, ends: torch.Tensor,
                             out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None) -> torch.Tensor:
    """out[e] = a[:, seg_e] @ b[:, seg_e].T -> [E, M, N] for NVFP4 a [M, T], b [N, T], both in 1x16 blocks
    along T (the tokens); seg_e = [ends[e-1], ends[e]) (ends[-1] = 0), every bound a multiple of 16 (each
    expert's tokens zero-padded to whole blocks), ends[E-1] <= T (columns past it are not read). An empty
    segment gives zeros.
    Global scales: per tensor, or per row of a / of b. One launch; the segment bounds stay on the device."""
    _check_wgrad(a, b, ends, out_dtype)
    ends = ends.to(a.device)
    if gemm_path(a.device, backend) == "torch":
        return _torch_wgrad(a, b, ends, out_dtype)
    return _triton_wgrad(a, b, ends, out_dtype)  # Blackwell too: the portable kernel (bounds on the device)
