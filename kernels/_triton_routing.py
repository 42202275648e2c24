"""Triton kernel of the fused top-k routing (contract, orders and references in ``routing``).

One program (one warp) per row, reading the logits or (PARTS) the router GEMM's split-K partial sums; torch's
lane-wise sums as explicit trees (``_triton_torch_order``). The sort's (key, index, valid) triples travel as
one int64: ((key bits + 1) << 32) | index for a valid entry, 0 for an invalid one; for keys >= +0.0
(probabilities) comparing the high words is torch's swap test, up to swaps of two invalid entries, which are
equal. Launched with FMA contraction off; expf is libdevice's (numpy's under the interpreter).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_fused_ops import _div, _expf
from ._triton_pdl import pdl_wait
from ._triton_round import round_to
from ._triton_torch_order import element, xor_step


@triton.jit
def _bitonic_stage(packed, slot, STRIDE: tl.constexpr, SIZE: tl.constexpr):
    """torch's bitonicSwap on every pair (p, p + STRIDE): swap where key[p] > key[p + STRIDE] (an invalid
    entry being below every valid one), done where that equals bit SIZE of p."""
    partner = tl.gather(packed, slot ^ STRIDE, 0)
    lower = (slot & STRIDE) == 0
    a = tl.where(lower, packed, partner)
    b = tl.where(lower, partner, packed)
    swap = (a >> 32) > (b >> 32)
    return tl.where(swap == ((slot & SIZE) != 0), partner, packed)


@triton.jit
def _logits_at(row, idx, mask, parts_stride, rd, PARTS: tl.constexpr):
    """The row's logits at ``idx`` in fp32 (-inf where masked); PARTS > 1: ``row`` is split 0 of a GEMM's
    split-K partial sums, added here in split order and rounded to rd's dtype, as its sum pass does."""
    v = tl.load(row + idx, mask=mask, other=float("-inf")).to(tl.float32)
    if PARTS > 1:
        for sp in tl.static_range(1, PARTS):
            v += tl.load(row + sp * parts_stride + idx, mask=mask, other=0.0)
        v = round_to(v, rd.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def _route_kernel(logits, stride, parts_stride, rd, w_out, id_out, E, K, W: tl.constexpr, LOG_W: tl.constexpr,
                  IT: tl.constexpr, K_SLOTS: tl.constexpr, LOG_SLOTS: tl.constexpr, BX: tl.constexpr,
                  LOG_BX: tl.constexpr, NORM: tl.constexpr, HALVES: tl.constexpr, PARTS: tl.constexpr = 1,
                  PDL: tl.constexpr = False):
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    lane = tl.arange(0, W)

    # softmax: element (i, l) = index l + W i; the row max; lane sums in i order; the xor butterfly
    idx2 = tl.arange(0, IT)[:, None] * W + lane[None, :]
    x = _logits_at(row, idx2, idx2 < E, parts_stride, rd, PARTS)
    mx = tl.max(tl.max(x, axis=1), axis=0)
    s = tl.zeros([W], dtype=tl.float32)
    for i in tl.static_range(IT):
        xi = _logits_at(row, i * W + lane, i * W + lane < E, parts_stride, rd, PARTS)
        s = s + _expf(xi - mx)
    for j in tl.static_range(LOG_W):
        s = xor_step(s, lane, W >> (j + 1))
    total = element(s, lane, 0)
    p = tl.reshape(_div(_expf(x - mx), total), [IT * W])

    # top-k: k rounds take the largest left (the lowest index among equals), the last one is the k-th
    n: tl.constexpr = IT * W
    ar = tl.arange(0, n)
    bits = tl.where(ar < E, p.to(tl.int32, bitcast=True), -1)
    left = bits
    kth = tl.max(bits, axis=0)
    for _ in range(K):
        kth = tl.max(left, axis=0)
        first = tl.min(tl.where(left == kth, ar, n), axis=0)
        left = tl.where(ar == first, -2, left)
    sel = left == -2
    # the radix select's write order: the values above the k-th in index order, then the equal ones
    above = bits > kth
    eq = sel & (bits == kth)
    pos = tl.where(above, tl.cumsum(above.to(tl.int32), axis=0) - 1,
                   tl.sum(above.to(tl.int32), axis=0) + tl.cumsum(eq.to(tl.int32), axis=0) - 1)
    slot = tl.arange(0, K_SLOTS)
    packed_i = ((bits.to(tl.int64) + 1) << 32) | ar.to(tl.int64)
    hit = (pos[None, :] == slot[:, None]) & sel[None, :]
    packed = tl.sum(tl.where(hit, packed_i[None, :], 0), axis=1)

    # torch's bitonic network over the slots
    for a in tl.static_range(LOG_SLOTS - 1):  # sizes 2, 4, .. K_SLOTS / 2; strides size / 2 .. 1
        for b in tl.static_range(a + 1):
            packed = _bitonic_stage(packed, slot, (1 << a) >> b, 2 << a)
    for b in tl.static_range(LOG_SLOTS):      # the final merge
        packed = _bitonic_stage(packed, slot, K_SLOTS >> (b + 1), 0)

    key = ((packed >> 32) - 1).to(tl.int32).to(tl.float32, bitcast=True)
    w = key
    if NORM:
        v = tl.where(slot < K, key, 0.0)
        if BX < K_SLOTS:
            v = xor_step(v, slot, BX)  # lane l: element l + element l + BX (0.0 where there is none)
        for j in tl.static_range(LOG_BX):
            if HALVES:
                v = xor_step(v, slot, BX >> (j + 1))
            else:
                v = xor_step(v, slot, 1 << j)
        w = _div(key, element(v, slot, 0))
    out = slot < K
    tl.store(w_out + r * K + slot, round_to(w, w_out.dtype.element_ty), mask=out)
    tl.store(id_out + r * K + slot, packed & 0xFFFFFFFF, mask=out)
