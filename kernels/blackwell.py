"""Blackwell (sm_100 / sm_103) dense path: native FP4 tensor cores through ``torch._scaled_mm``.

Not runnable on this project's Hopper machines, so it is kept small: the codes are reinterpreted as
``torch.float4_e2m1fn_x2`` (element 2j in the low nibble, as minite.nvfp4 packs them), the E4M3 block scales
are re-laid out into cuBLAS's swizzled 128x4 tile layout (``to_blocked``; ``from_blocked`` inverts it, tests
check the round trip on CPU), cuBLAS accumulates in fp32, and both global scales plus the bias are applied
after, in fp32. Batch invariance there is cuBLAS's, not ours: see docs/KERNELS_NOTES.md. Never use
``tl.dot_scaled`` with NVFP4 scales on Hopper (Triton 3.6 crashes on sm_90); this path is gated on sm_100+.
"""
from __future__ import annotations

import torch


def is_blackwell(cap: tuple[int, int]) -> bool:
    return cap[0] == 10


def _ceil(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """[R, C] block scales -> cuBLAS's swizzled layout, flattened: rows padded to 128 and columns to 4 (zero
    padding), each 128x4 tile stored as 32 rows of (4 row-groups x 4 columns)."""
    r, c = scales.shape
    rp, cp = _ceil(r, 128), _ceil(c, 4)
    if (rp, cp) != (r, c):
        padded = torch.zeros(rp, cp, dtype=scales.dtype, device=scales.device)
        padded[:r, :c] = scales
        scales = padded
    t = scales.view(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3)  # [row tile, col tile, 128, 4]
    t = t.reshape(-1, 4, 32, 4).transpose(1, 2)                       # row = 32*i + r -> [r, i, col]
    return t.reshape(-1).contiguous()


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``to_blocked`` (drops the padding)."""
    rp, cp = _ceil(rows, 128), _ceil(cols, 4)
    t = blocked.view(-1, 32, 4, 4).transpose(1, 2).reshape(rp // 128, cp // 4, 128, 4)
    return t.permute(0, 2, 1, 3).reshape(rp, cp)[:rows, :cols]


def gemm(a, w, out_dtype, bias) -> torch.Tensor:
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        raise RuntimeError("the Blackwell NVFP4 path needs torch.float4_e2m1fn_x2 (PyTorch >= 2.8)")
    m, n = a.shape[0], w.shape[0]
    acc = torch._scaled_mm(a.codes.contiguous().view(fp4), w.codes.contiguous().view(fp4).t(),
                           scale_a=to_blocked(a.scales), scale_b=to_blocked(w.scales),
                           out_dtype=torch.float32)
    out = acc * a.row_global_scale().view(m, 1) * w.row_global_scale().view(1, n)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
