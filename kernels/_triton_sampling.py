"""Triton kernel of the inverse-CDF sampler (contract and launch in ``sampling``)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_exps(row, start, V, t, mx, BLOCK: tl.constexpr):
    """exp(z - max) of one block of the row's z = logits / t (0 past the vocabulary), and its valid mask."""
    offs = start + tl.arange(0, BLOCK)
    ok = offs < V
    z = tl.load(row + offs, mask=ok, other=0.0) / t
    return tl.where(ok, tl.exp(z - mx), 0.0)


@triton.jit
def _inverse_cdf_kernel(logits, stride, temp, uniform, out, V, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = logits + r.to(tl.int64) * stride
    t = tl.load(temp)
    lane = tl.arange(0, BLOCK)
    # pass 1: the row's max of z
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        z = tl.load(row + start + lane, mask=start + lane < V, other=float("-inf")) / t
        m = tl.maximum(m, z)
    mx = tl.max(m, axis=0)
    # pass 2: the total, block sums added in block order
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, V, BLOCK):
        total += tl.sum(_block_exps(row, start, V, t, mx, BLOCK), axis=0)
    target = tl.load(uniform + r) * total
    # pass 3: the same block sums in the same order, so the running sum reaches exactly `total`; the first
    # block where it exceeds the target holds the token (none can, when draw x total rounds up to total:
    # then the last block with mass, and its last token with mass)
    run = total * 0.0
    before = total * 0.0
    last_before = total * 0.0
    blk = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0) - 1
    last_blk = blk
    for start in range(0, V, BLOCK):
        s = tl.sum(_block_exps(row, start, V, t, mx, BLOCK), axis=0)
        hit = (blk < 0) & (run + s > target)
        blk = tl.where(hit, start, blk)
        before = tl.where(hit, run, before)
        last_blk = tl.where(s > 0, start, last_blk)
        last_before = tl.where(s > 0, run, last_before)
        run += s
    found = blk >= 0
    start = tl.where(found, blk, last_blk)
    e = _block_exps(row, start, V, t, mx, BLOCK)
    c = tl.where(found, before, last_before) + tl.cumsum(e, axis=0)
    first = tl.min(tl.where((c > target) & (e > 0), lane, BLOCK), axis=0)
    last_nz = tl.max(tl.where(e > 0, lane, -1), axis=0)
    idx = tl.where(found & (first < BLOCK), first, last_nz)
    tl.store(out + r, (start + idx).to(tl.int64))
