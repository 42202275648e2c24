"""Triton pieces that reproduce the summation order of torch's CUDA reduction kernels (``routing`` and
``fused_ops`` say which kernels, and why their orders are needed).

A lane-wise reduction of torch's becomes an explicit tree over a small vector: ``xor_step`` adds each
element to its partner at distance D (v[l] + v[l ^ D], its own value first), which for the lanes that matter
is torch's shuffle step; ``element`` takes one value out of a vector by a masked sum with zeros, which is
exact. (With one warp and a vector of 32, the partner reads lower to warp shuffles.)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def xor_step(v, lane, D: tl.constexpr):
    """v[l] + v[l ^ D] for every l."""
    return v + tl.gather(v, lane ^ D, 0)


@triton.jit
def element(v, idx, i):
    """v[i], exactly (one term and zeros)."""
    return tl.sum(tl.where(idx == i, v, tl.zeros_like(v)), axis=0)


@triton.jit
def add_to_accumulator(a0, a1, a2, a3, v, TERM: tl.constexpr):
    """(a0, a1, a2, a3) with v added to accumulator TERM % 4: torch's four-accumulator reductions (the vectorized
    row reduce, ``thread_reduce``) give term TERM to accumulator TERM % 4 (TERM: a compile-time index)."""
    if TERM % 4 == 0:
        a0 = a0 + v
    elif TERM % 4 == 1:
        a1 = a1 + v
    elif TERM % 4 == 2:
        a2 = a2 + v
    else:
        a3 = a3 + v
    return a0, a1, a2, a3


@triton.jit
def vec4_row_sum(a0, a1, a2, a3):
    """torch's sum of a row from its 32 lanes' four accumulators a0..a3 [32] (``input_vectorized_thread_reduce``:
    accumulator i of lane l holds elements 4 (l + 32 j) + i, added in j order from 0.0): the four combined in
    order, then the lanes by a shuffle tree with decreasing offsets (halves)."""
    c = ((a0 + a1) + a2) + a3
    lane = tl.arange(0, 32)
    for j in tl.static_range(5):
        c = xor_step(c, lane, 16 >> j)
    return element(c, lane, 0)
