"""NVFP4 weights as the GEMMs take them: stacked experts, the one-time fp16 re-layouts, input checks, and
which path (Triton, Blackwell, PyTorch) a device gets. Kept apart from ``gemm`` (the launches)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minite.nvfp4 import NVFP4Tensor

from . import _backend, blackwell


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def gemm_path(device: torch.device, backend: str | None = None) -> str:
    """'triton' (Hopper kernel), 'blackwell' (sm_100/103) or 'torch' for tensors on ``device``."""
    b = _backend.resolve(backend, device)
    if b == "torch":
        return "torch"
    if device.type == "cuda" and blackwell.is_blackwell(_backend.capability(device)) \
            and os.environ.get("MINITE_KERNELS_BLACKWELL", "1") != "0":
        return "blackwell"
    return "triton"


@dataclass
class NVFP4Experts:
    """E expert weights [N, K] stacked: codes uint8 [E, N, K/2], scales e4m3 [E, N, K/16], global_scale
    float32 [E] (one per expert) or [E, N] (per row). Build once with ``stack_experts`` (a list costs a copy
    on every call)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    f16: torch.Tensor | None = None  # [E, N, cdiv(K, 128) * 128] pre-decoded (``prepare_experts``), or None
    frag: torch.Tensor | None = None  # codes in the decode kernel's fragment order (``decode_layout``), or None

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, kh = self.codes.shape
        return (e, n, kh * 2)

    def to(self, device) -> "NVFP4Experts":
        def move(t):
            return None if t is None else t.to(device)
        return NVFP4Experts(self.codes.to(device), self.scales.to(device), self.global_scale.to(device),
                            move(self.f16), move(self.frag))


def stack_experts(ws) -> NVFP4Experts:
    """List of E NVFP4Tensors [N, K] -> NVFP4Experts. Global scales stay scalars [E] when every expert has
    one; if any expert carries per-row scales (fused gate/up shards with their own scales), scalar ones are
    expanded to rows so the stack is [E, N]."""
    if isinstance(ws, NVFP4Experts):
        return ws
    ws = list(ws)
    if not ws:
        raise ValueError("grouped_nvfp4_gemm: no expert weights")
    per_row = any(w.global_scale.dim() for w in ws)
    for w in ws:
        _check_tensor(w, "expert weight")
        if w.shape != ws[0].shape:
            raise ValueError(f"grouped_nvfp4_gemm: expert shapes differ: {w.shape} vs {ws[0].shape}")
    gs = [(w.row_global_scale() if per_row else w.global_scale).to(torch.float32) for w in ws]
    return NVFP4Experts(torch.stack([w.codes for w in ws]), torch.stack([w.scales for w in ws]), torch.stack(gs))


def prepare_experts(ws, backend: str | None = None) -> NVFP4Experts:
    """``stack_experts`` plus the pre-decoded fp16 copy of every expert (4x the packed bytes, once): the
    grouped GEMM then runs the fast large-M path (same bits). Without the Triton path: just stacked."""
    ex = stack_experts(ws)
    if ex.f16 is not None or gemm_path(ex.codes.device, backend) != "triton":
        return ex
    e, n, k = ex.shape
    flat = NVFP4Tensor(ex.codes.reshape(e * n, k // 2), ex.scales.reshape(e * n, k // 16),
                       torch.ones((), device=ex.codes.device))
    return NVFP4Experts(ex.codes, ex.scales, ex.global_scale, decode_f16(flat).view(e, n, -1))


def fragment_order(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., N, K/2] (N a multiple of 16, K of 128) -> the CUDA decode kernel's fragment-order
    codes (``decode_gemm.cu``, FRAG), same shape and size: per 16-row group and 128-wide K step the 1 KB a
    warp reads, as [half][lane 4g + t][word 2 (pc & 1) + r][4 bytes], word (pc, r) holding the code bytes
    16 pc + 2t, +1 and 16 pc + 8 + 2t, +1 of row g + 8 r (pc = 2 half + (pc & 1)): the words a lane gathers,
    in the order it uses them. Each word's eight elements are stored for the kernel's four fp16x2 pairs (evens
    of bytes 0, 1 / 2, 3; odds of bytes 0, 1 / 2, 3; a pair's first element in the low 16 bits, its second in the
    high ones, each as sign and 3-bit magnitude): per half, mag << 9 | sign << 15 (evens 0, 1: one mask leaves
    the fp16 bits of e2m1 * 2^-14), mag << 6 | sign << 12 (evens 2, 3: a shift by 3 and the mask), mag | sign
    << 14 (odds 0, 1: masked, times 2^9 + 2^1, masked) and mag << 3 | sign << 13 (odds 2, 3: times 2^6 + 2^2).
    Nine integer operations per word, six of them on the ALU pipe (``_decode_twin.frag_pairs``)."""
    *lead, n, kh = codes.shape
    if n % 16 or kh % 64:
        raise ValueError(f"fragment_order: codes [..., N, K/2] need N % 16 == 0 and K % 128 == 0, "
                         f"got {tuple(codes.shape)}")
    # [groups, r, g, step, pc_hi, pc_lo, h, t, j]: row 16 group + 8 r + g, byte 16 (2 pc_hi + pc_lo) + 8 h + 2 t + j
    v = codes.reshape(*lead, n // 16, 2, 8, kh // 64, 2, 2, 2, 4, 2)
    d = len(lead)
    order = [*range(d), d, d + 3, d + 4, d + 2, d + 7, d + 5, d + 1, d + 6, d + 8]
    b = v.permute(order).contiguous().reshape(*codes.shape[:-1], kh // 4, 4)
    mag, sign = b & 0x77, (b >> 3) & 0x11  # per byte: even element in the low nibble, odd in the high one
    out = torch.empty_like(b)
    for h in (0, 1):  # the pairs' element h: the evens / odds of bytes h and 2 + h -> word bytes 2h, 2h + 1
        m01, m23, s01, s23 = mag[..., h], mag[..., 2 + h], sign[..., h], sign[..., 2 + h]
        out[..., 2 * h] = (m01 >> 4) | (m23 >> 4) << 3 | (m23 & 3) << 6
        out[..., 2 * h + 1] = ((m23 & 4) >> 2 | (m01 & 7) << 1 | (s23 & 1) << 4 | (s23 >> 4) << 5
                               | (s01 >> 4) << 6 | (s01 & 1) << 7)
    return out.reshape(codes.shape)


def decode_layout(w, backend: str | None = None):
    """A weight (NVFP4Tensor or ``PreparedWeight`` -> ``PreparedWeight``) or experts (a list or
    ``NVFP4Experts`` -> ``NVFP4Experts``) with the codes also in fragment order (``fragment_order``: one more
    copy of the packed bytes) where the CUDA decode kernel can run (CUDA device, Triton path,
    ``MINITE_KERNELS_CUDA`` not 0). The decode GEMMs then read each warp's K step as one contiguous 1 KB with
    two shared loads per lane and fewer decode operations (same values, same bits). Elsewhere the weight is
    returned as it came (experts stacked). Make it once per weight version (a sampler's sync), not per call."""
    from . import _cuda_decode
    dense = isinstance(w, (NVFP4Tensor, PreparedWeight))
    x = w if dense else stack_experts(w)
    codes = (x.w if isinstance(x, PreparedWeight) else x).codes
    if getattr(x, "frag", None) is not None or codes.device.type != "cuda" or not _cuda_decode.enabled() \
            or gemm_path(codes.device, backend) != "triton" or codes.shape[-2] % 16 or codes.shape[-1] % 64:
        return x
    if isinstance(x, NVFP4Tensor):
        return PreparedWeight(x, None, fragment_order(codes))
    if isinstance(x, PreparedWeight):
        return PreparedWeight(x.w, x.f16, fragment_order(codes))
    return NVFP4Experts(x.codes, x.scales, x.global_scale, x.f16, fragment_order(codes))


def _check_tensor(t, what: str) -> None:
    if not hasattr(t, "codes") or not hasattr(t, "scales") or not hasattr(t, "global_scale"):
        raise TypeError(f"{what} must be an NVFP4Tensor (codes, scales, global_scale), got {type(t)}")
    c, s, g = t.codes, t.scales, t.global_scale
    if c.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{what}: codes must be uint8 and scales float8_e4m3fn, got {c.dtype} / {s.dtype}")
    if c.dim() != 2 or s.dim() != 2 or s.shape[0] != c.shape[0] or s.shape[1] * 8 != c.shape[1]:
        raise ValueError(f"{what}: codes [R, K/2] and scales [R, K/16] do not match: {tuple(c.shape)}, "
                         f"{tuple(s.shape)}")
    if g.dtype != torch.float32 or not (g.dim() == 0 or (g.dim() == 1 and g.shape[0] == c.shape[0])):
        raise ValueError(f"{what}: global_scale must be float32 [] or [{c.shape[0]}], got {g.dtype} "
                         f"{tuple(g.shape)}")
    if not (c.device == s.device == g.device):
        raise ValueError(f"{what}: codes, scales and global_scale are on different devices")


@dataclass
class PreparedWeight:
    """A weight kept in the forms its GEMMs read: packed NVFP4, pre-decoded fp16 in the GEMM's K order
    (``prepare_weight``; ``decode_f16``: exact values * 2**-14, 4x the packed bytes) for large M, where
    decoding inside the main loop would cost more ALU time than the tensor cores take, and / or the codes in
    the CUDA decode kernel's fragment order (``decode_layout``) for few rows. Same bits whichever is read."""

    w: NVFP4Tensor
    f16: torch.Tensor | None = None   # [N, cdiv(K, 128) * 128], or None: decoded per call where needed
    frag: torch.Tensor | None = None  # [N, K/2] fragment-order codes, or None

    @property
    def shape(self):
        return self.w.shape

    @property
    def device(self):
        return self.w.device


@dataclass
class DecodedNVFP4Tensor(NVFP4Tensor):
    """NVFP4 token rows with their fp16 form in the GEMM's K order (``decode_f16``'s layout and bits), written by
    the cast that made the codes (``quantize_rms_norm(..., f16=True)``): a GEMM that reads fp16 tokens takes it
    instead of a ``decode_f16`` pass of its own. Row views and gathers (``rows``, ``take``) are plain
    NVFP4Tensors."""

    f16: torch.Tensor | None = None  # [M, cdiv(K, 128) * 128]


def decode_f16(t) -> torch.Tensor:
    """NVFP4 [R, K] -> fp16 [R, cdiv(K, 128) * 128] in the kernel's K order (Triton; GPU or interpreter).
    (An int32-word version of this pass compiled to more instructions on sm_90 than this byte one, which
    already issues 8-byte code loads and 16-byte stores: not kept.)"""
    from . import _triton_gemm as tg
    r, k = t.shape
    kp = (k + tg.BK - 1) // tg.BK * tg.BK
    out = torch.empty(r, kp, dtype=torch.float16, device=t.codes.device)
    if r:
        br = 16 if t.codes.device.type == "cpu" else 64
        tg.decode_f16_kernel[((r + br - 1) // br, kp // tg.BK)](t.codes.contiguous(), _u8(t.scales), out, r, k,
                                                                BR=br, BK=tg.BK, num_warps=4)
    return out


def prepare_weight(w: NVFP4Tensor, backend: str | None = None):
    """One-time re-layout of a weight for ``nvfp4_gemm`` (keep the result, pass it as ``w``). On the Triton
    path it adds the pre-decoded fp16 copy; elsewhere it returns ``w`` unchanged."""
    _check_tensor(w, "w")
    if gemm_path(w.device, backend) != "triton":
        return w
    return PreparedWeight(w, decode_f16(w))
