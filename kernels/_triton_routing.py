"""Triton kernel of the fused top-k routing (contract, orders and references in ``routing``).

One program per row. Lane-wise reductions of torch's kernels become explicit trees over small vectors:
``_xor_step`` adds each element to its partner at a given distance (v[l] + v[l ^ d]), which for the lanes
that matter is torch's shuffle step; elements are taken out of a vector by a masked sum with zeros, which
is exact. Launched with FMA contraction off; expf is libdevice's (numpy's under the interpreter).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_fused_ops import _div, _expf
from ._triton_round import round_to


@triton.jit
def _pairs(v, N: tl.constexpr, D: tl.constexpr):
    """v [N] -> (a, b) [N // (2D), D]: the elements with bit D of their index clear, and their partners."""
    return tl.split(tl.permute(tl.reshape(v, [N // (2 * D), 2, D]), (0, 2, 1)))


@triton.jit
def _unpairs(a, b, N: tl.constexpr):
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [N])


@triton.jit
def _xor_step(v, N: tl.constexpr, D: tl.constexpr):
    """v[l] + v[l ^ D] for every l (the element's own value first)."""
    a, b = _pairs(v, N, D)
    return _unpairs(a + b, b + a, N)


@triton.jit
def _element(v, idx, i):
    """v[i], exactly (one term and zeros)."""
    return tl.sum(tl.where(idx == i, v, tl.zeros_like(v)), axis=0)


@triton.jit
def _bitonic_stage(key, val, valid, N: tl.constexpr, STRIDE: tl.constexpr, SIZE: tl.constexpr):
    """torch's bitonicSwap on every pair (p, p + STRIDE): swap = (key[p] > key[p+S] (NaN first) and p valid)
    or p + S invalid; the pair is swapped where swap equals bit SIZE of p."""
    ka, kb = _pairs(key, N, STRIDE)
    va, vb = _pairs(val, N, STRIDE)
    ga, gb = _pairs(valid, N, STRIDE)
    pos = (tl.arange(0, N // (2 * STRIDE))[:, None] * (2 * STRIDE) + tl.arange(0, STRIDE)[None, :])
    gt = ((ka != ka) & (kb == kb)) | (ka > kb)
    swap = (gt & (ga != 0)) | (gb == 0)
    flag = (pos & SIZE) != 0
    do = swap == flag
    key = _unpairs(tl.where(do, kb, ka), tl.where(do, ka, kb), N)
    val = _unpairs(tl.where(do, vb, va), tl.where(do, va, vb), N)
    valid = _unpairs(tl.where(do, gb, ga), tl.where(do, ga, gb), N)
    return key, val, valid


@triton.jit
def _route_kernel(logits, stride, w_out, id_out, E, K, W: tl.constexpr, LOG_W: tl.constexpr, IT: tl.constexpr,
                  K_SLOTS: tl.constexpr, LOG_SLOTS: tl.constexpr, BX: tl.constexpr, LOG_BX: tl.constexpr,
                  NORM: tl.constexpr, HALVES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    lane = tl.arange(0, W)

    # softmax: element (i, l) = index l + W i; the row max; lane sums in i order; the xor butterfly
    idx2 = tl.arange(0, IT)[:, None] * W + lane[None, :]
    x = tl.load(row + idx2, mask=idx2 < E, other=float("-inf")).to(tl.float32)
    mx = tl.max(tl.max(x, axis=1), axis=0)
    s = tl.zeros([W], dtype=tl.float32)
    for i in tl.static_range(IT):
        xi = tl.load(row + i * W + lane, mask=i * W + lane < E, other=float("-inf")).to(tl.float32)
        s = s + _expf(xi - mx)
    for j in tl.static_range(LOG_W):
        s = _xor_step(s, W, W >> (j + 1))
    total = _element(s, lane, 0)
    p = tl.reshape(_div(_expf(x - mx), total), [IT * W])

    # top-k: every value above the k-th largest, then the lowest-index equal ones, in that write order
    n: tl.constexpr = IT * W
    ar = tl.arange(0, n)
    bits = tl.where(ar < E, p.to(tl.int32, bitcast=True), -1)
    bi, bj = bits[:, None], bits[None, :]
    before = ar[None, :] < ar[:, None]
    rank = tl.sum((bj > bi).to(tl.int32), axis=1) + tl.sum(((bj == bi) & before).to(tl.int32), axis=1)
    sel = (rank < K) & (ar < E)
    kth = tl.max(tl.where(rank == K - 1, bits, -1), axis=0)
    above = bits > kth
    n_above = tl.sum(above.to(tl.int32), axis=0)
    pos = tl.where(above, tl.sum(((bj > kth) & before).to(tl.int32), axis=1),
                   n_above + tl.sum(((bj == kth) & sel[None, :] & before).to(tl.int32), axis=1))
    slot = tl.arange(0, K_SLOTS)
    hit = (pos[None, :] == slot[:, None]) & sel[None, :]
    key = tl.sum(tl.where(hit, p[None, :], 0.0), axis=1)
    val = tl.sum(tl.where(hit, ar[None, :], 0), axis=1)
    valid = tl.where(slot < K, 1, 0)

    # torch's bitonic network over the slots
    for a in tl.static_range(LOG_SLOTS - 1):  # sizes 2, 4, .. K_SLOTS / 2; strides size / 2 .. 1
        for b in tl.static_range(a + 1):
            key, val, valid = _bitonic_stage(key, val, valid, K_SLOTS, (1 << a) >> b, 2 << a)
    for b in tl.static_range(LOG_SLOTS):      # the final merge
        key, val, valid = _bitonic_stage(key, val, valid, K_SLOTS, K_SLOTS >> (b + 1), 0)

    w = key
    if NORM:
        v = tl.where(slot < K, key, 0.0)
        if BX < K_SLOTS:
            v = _xor_step(v, K_SLOTS, BX)  # lane l: element l + element l + BX (0.0 where there is none)
        for j in tl.static_range(LOG_BX):
            if HALVES:
                v = _xor_step(v, K_SLOTS, BX >> (j + 1))
            else:
                v = _xor_step(v, K_SLOTS, 1 << j)
        w = _div(key, _element(v, slot, 0))
    out = slot < K
    tl.store(w_out + r * K + slot, round_to(w, w_out.dtype.element_ty), mask=out)
    tl.store(id_out + r * K + slot, val.to(tl.int64), mask=out)
