"""Triton kernels of the batch-invariant BF16 GEMM (launch, configs and contract in ``hp_gemm``)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_gemm import _l2_tile, _tile_index
from ._triton_pdl import pdl_wait
from ._triton_round import round_to


@triton.jit
def invariant_mm_kernel(x, w, bias, out, part, M, N, K, k_per_split, sxm, sxk, swn, swk,
                        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_DOT: tl.constexpr,
                        ROUND_TO_X: tl.constexpr = False, PDL: tl.constexpr = False):
    """out (or part[split]) tile = x[rows, ks] @ w[cols, ks].T over this split's K range, BK at a time.
    UPCAST_DOT (interpreter only): fp32 operands; the interpreter's dot multiplies bf16 storage bits.
    ROUND_TO_X: round to x's dtype, then store in out's (a wider one: the same values, no cast pass after)."""
    pdl_wait(PDL)
    pid_m, pid_n = _l2_tile(tl.cdiv(M, BM), N, BN, GROUP_M)
    _, cols, rmask, nmask, rows64, cols64 = _tile_index(pid_m * BM, M, pid_n, N, BM, BN)
    k0 = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k0 + k_per_split)
    kk = tl.arange(0, BK)
    x_ptrs = x + rows64[:, None] * sxm + kk[None, :] * sxk
    w_ptrs = w + cols64[:, None] * swn + kk[None, :] * swk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k0, k_end, BK):
        kmask = (k + kk) < k_end
        a = tl.load(x_ptrs + k * sxk, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptrs + k * swk, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
    omask = rmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + tl.load(bias + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ROUND_TO_X:
            val = round_to(acc, x.dtype.element_ty).to(out.dtype.element_ty)
        else:
            val = round_to(acc, out.dtype.element_ty)
        tl.store(out + rows64[:, None] * N + cols64[None, :], val, mask=omask)
    else:
        p = part + tl.program_id(1).to(tl.int64) * M * N
        tl.store(p + rows64[:, None] * N + cols64[None, :], acc, mask=omask)


@triton.jit
def split_k_sum_kernel(part, bias, out, x, M, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK: tl.constexpr, ROUND_TO_X: tl.constexpr = False, PDL: tl.constexpr = False):
    """out = part[0] + part[1] + ... (in this order, fp32) + bias, rounded once (ROUND_TO_X: to x's dtype,
    stored in out's; x is read for its dtype only)."""
    pdl_wait(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    if ROUND_TO_X:
        val = round_to(acc, x.dtype.element_ty).to(out.dtype.element_ty)
    else:
        val = round_to(acc, out.dtype.element_ty)
    tl.store(out + offs, val, mask=mask)
