"""Triton kernels of the inverse-CDF sampler (contract and launch in ``sampling``)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_z(logits, stride, temp, V, BLOCK: tl.constexpr):
    """z = logits / t of block program_id(1) of row program_id(0) (-inf past the vocabulary), and its offsets."""
    row = logits + tl.program_id(0).to(tl.int64) * stride
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return tl.load(row + offs, mask=offs < V, other=float("-inf")) / tl.load(temp), offs


@triton.jit
def _row_max(block_max, r, NB, NB_P2: tl.constexpr):
    j = tl.arange(0, NB_P2)
    return tl.max(tl.load(block_max + r * NB + j, mask=j < NB, other=float("-inf")), axis=0)


@triton.jit
def _block_max_kernel(logits, stride, temp, block_max, V, NB, BLOCK: tl.constexpr):
    """Pass 1, one program per (row, block): the block's max of z."""
    z, _ = _block_z(logits, stride, temp, V, BLOCK)
    tl.store(block_max + tl.program_id(0) * NB + tl.program_id(1), tl.max(z, axis=0))


@triton.jit
def _exps(z, offs, V, mx):
    return tl.where(offs < V, tl.exp(z - mx), 0.0)


@triton.jit
def _block_sum_kernel(logits, stride, temp, block_max, block_sum, V, NB, BLOCK: tl.constexpr,
                      NB_P2: tl.constexpr):
    """Pass 2, one program per (row, block): the block's sum of exp(z - the row's max)."""
    r = tl.program_id(0)
    z, offs = _block_z(logits, stride, temp, V, BLOCK)
    mx = _row_max(block_max, r, NB, NB_P2)
    tl.store(block_sum + r * NB + tl.program_id(1), tl.sum(_exps(z, offs, V, mx), axis=0))


@triton.jit
def _pick_kernel(logits, stride, temp, block_max, block_sum, uniform, out, V, NB, BLOCK: tl.constexpr,
                 NB_P2: tl.constexpr):
    """Pass 3, one program per row: the total (block sums added in block order), the first block where the
    running sum exceeds draw x total (none can, when that product rounds up to the total: then the last block
    with mass, and its last token with mass), and inside it the token, by a cumulative sum of its exps."""
    r = tl.program_id(0)
    row = logits + r.to(tl.int64) * stride
    t = tl.load(temp)
    mx = _row_max(block_max, r, NB, NB_P2)
    total = tl.sum(tl.zeros([NB_P2], tl.float32), axis=0)
    for j in range(0, NB):
        total += tl.load(block_sum + r * NB + j)
    target = tl.load(uniform + r) * total
    run = total * 0.0
    before = total * 0.0
    last_before = total * 0.0
    blk = tl.sum(tl.zeros([NB_P2], tl.int32), axis=0) - 1
    last_blk = blk
    for j in range(0, NB):
        s = tl.load(block_sum + r * NB + j)
        hit = (blk < 0) & (run + s > target)
        blk = tl.where(hit, j, blk)
        before = tl.where(hit, run, before)
        last_blk = tl.where(s > 0, j, last_blk)
        last_before = tl.where(s > 0, run, last_before)
        run += s
    found = blk >= 0
    start = tl.where(found, blk, last_blk) * BLOCK
    lane = tl.arange(0, BLOCK)
    offs = start + lane
    e = _exps(tl.load(row + offs, mask=offs < V, other=float("-inf")) / t, offs, V, mx)
    c = tl.where(found, before, last_before) + tl.cumsum(e, axis=0)
    first = tl.min(tl.where((c > target) & (e > 0), lane, BLOCK), axis=0)
    last_nz = tl.max(tl.where(e > 0, lane, -1), axis=0)
    idx = tl.where(found & (first < BLOCK), first, last_nz)
    tl.store(out + r, (start + idx).to(tl.int64))


@triton.jit
def _record_kernel(tok, logp, lp_stride, mx, logsum, slots, nxt, end, tokens, logprobs, tab_stride, stopped, stop,
                   ids, pos, trash, WRITE_TOKENS: tl.constexpr, ADVANCE: tl.constexpr, STATS: tl.constexpr):
    """Row program_id(0) of ``sampling.record_tokens``: integer moves and one fp32 copy (STATS: logp holds the
    logits and the log-prob is (logits[tok] - mx) - logsum, torch's epilogue), nothing else rounded."""
    i = tl.program_id(0)
    t = tl.load(tok + i)
    n = tl.load(nxt + i)
    slot = tl.load(slots + i)
    col = tl.where(n < tl.load(end + slot), n, trash)
    cell = slot * tab_stride + col
    if WRITE_TOKENS:
        tl.store(tokens + cell, t)
    lp = tl.load(logp + i.to(tl.int64) * lp_stride + t)
    if STATS:
        lp = (lp - tl.load(mx + i)) - tl.load(logsum + i)
    tl.store(logprobs + cell, lp)
    tl.store(stopped + slot, tl.load(stopped + slot) | (t == tl.load(stop)))
    if ADVANCE:
        tl.store(ids + i, t)
        tl.store(pos + i, n)
