"""Pure-PyTorch NVFP4 GEMM: exact, batch invariant, for CPU (and any device without Triton).

Every block value e2m1 * e4m3 is an integer multiple of 2**-10 below 2**12, so a product of two is a multiple
of 2**-20 below 2**24 and any sum of 512 of them is an integer below 2**53 times 2**-20: exact in float64,
whatever order the BLAS uses. K is cut into fixed 512-wide chunks (exact partial sums), added in a fixed
sequential order; so row i's result never depends on M, the thread count or the BLAS kernel chosen. Global
scales are applied in float64 after, then one rounding to fp32 (as the reference), bias in fp32, then the cast.
"""
from __future__ import annotations

import torch

from minite import nvfp4 as ref

CHUNK = 512  # 2**9 products of < 2**44 units each: exact in float64


def block_values(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """[R, K/2] codes + [R, K/16] e4m3 -> exact e2m1 * scale values [R, K] (float64 or float32; both exact)."""
    r = codes.shape[0]
    table = torch.tensor(ref.E2M1_VALUES, dtype=dtype, device=codes.device)
    vals = table[ref.unpack_codes(codes).long()].view(r, -1, ref.BLOCK)
    return (vals * scales.to(dtype)[..., None]).view(r, -1)


def exact_dot(av: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """float64 av @ wv.T, summed in fixed 512-wide K chunks (exact chunks, fixed order)."""
    k = av.shape[1]
    acc = None
    for k0 in range(0, k, CHUNK):
        part = av[:, k0:k0 + CHUNK] @ wv[:, k0:k0 + CHUNK].T
        acc = part if acc is None else acc + part
    return acc


def epilogue(acc64: torch.Tensor, ga: torch.Tensor, gw: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """acc (float64) * ga[:, None] * gw[None, :] -> fp32 (one rounding) -> + bias (fp32) -> out_dtype."""
    out = (acc64 * ga.to(torch.float64)[:, None] * gw.to(torch.float64)[None, :]).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def gemm(a, w, out_dtype, bias) -> torch.Tensor:
    acc = exact_dot(block_values(a.codes, a.scales), block_values(w.codes, w.scales))
    return epilogue(acc, a.row_global_scale(), w.row_global_scale(), bias, out_dtype)


def grouped_gemm(a, ex, offsets: torch.Tensor, out_dtype, k_segments: int = 1) -> torch.Tensor:
    """Loop over experts (the offsets are read on the host: this is the CPU path). ``k_segments`` > 1: the
    experts' global scales [E, S] are per K segment (the segment sums, scaled, added in float64)."""
    m = a.codes.shape[0]
    e, n = ex.codes.shape[0], ex.codes.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a.codes.device)
    offs = offsets.tolist()
    av = block_values(a.codes, a.scales)
    ga = a.row_global_scale()
    for i in range(e):
        lo, hi = offs[i], offs[i + 1]
        if hi == lo:
            continue
        wv = block_values(ex.codes[i], ex.scales[i])
        if k_segments > 1:
            seg = wv.shape[1] // k_segments
            acc = sum(exact_dot(av[lo:hi, s * seg:(s + 1) * seg], wv[:, s * seg:(s + 1) * seg])
                      * ex.global_scale[i, s].to(torch.float64) for s in range(k_segments))
            out[lo:hi] = epilogue(acc, ga[lo:hi], wv.new_ones(n), None, out_dtype)
            continue
        gw = ex.global_scale[i]
        gw = gw.expand(n) if gw.dim() == 0 else gw
        out[lo:hi] = epilogue(exact_dot(av[lo:hi], wv), ga[lo:hi], gw, None, out_dtype)
    return out
