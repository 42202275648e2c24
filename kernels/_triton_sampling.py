"""Triton kernels of the inverse-CDF sampler (contract and launch in ``sampling``). Logits of any float dtype
are widened to fp32 as they are loaded."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_log_softmax import finished_stats, sum_part
from ._triton_pdl import pdl_wait
from ._triton_torch_order import element


@triton.jit
def _store_block_stats(x, z, idx, block_max, block_sum, block_raw_max, RAW_MAX: tl.constexpr,
                       Z_IS_X: tl.constexpr):
    """Block ``idx``'s max m of z, its sum of exp(z - m) (0 for a block without mass, whose m is -inf) and
    (RAW_MAX) its max of x: the max of z itself where z is x. Past the vocabulary z is -inf: exp(z - m) = 0."""
    m = tl.max(z, axis=0)
    s = tl.sum(tl.exp(z - m), axis=0)
    tl.store(block_max + idx, m)
    tl.store(block_sum + idx, tl.where(m == float("-inf"), 0.0, s))
    if RAW_MAX:
        if Z_IS_X:
            tl.store(block_raw_max + idx, m)
        else:
            tl.store(block_raw_max + idx, tl.max(x, axis=0))


@triton.jit
def _block_stats_kernel(logits, stride, temp, block_max, block_sum, block_raw_max, V, NB, BLOCK: tl.constexpr,
                        RAW_MAX: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 1, one program per (row, block): the block's statistics of z = logits / t (``_store_block_stats``).
    At t = 1 z is the logits themselves (x / 1 is x, bit for bit, -inf and NaN included), so that branch, one
    test of a scalar for the whole program, skips the IEEE division, the longest part of the per-element work
    (the logits sit in L2), and the second max. Each branch is its whole pass: a tensor carried out of the
    branch costs the other one its speed (measured)."""
    pdl_wait(PDL)
    row = logits + tl.program_id(0).to(tl.int64) * stride
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)  # -inf past the vocabulary
    t = tl.load(temp)
    idx = tl.program_id(0) * NB + tl.program_id(1)
    if t == 1.0:
        _store_block_stats(x, x, idx, block_max, block_sum, block_raw_max, RAW_MAX, True)
    else:
        _store_block_stats(x, x / t, idx, block_max, block_sum, block_raw_max, RAW_MAX, False)


@triton.jit
def _pick_kernel(logits, stride, temp, block_max, block_sum, block_raw_max, row_max, uniform, out, V, NB,
                 BLOCK: tl.constexpr, NB_P2: tl.constexpr, RAW_MAX: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 2, one program per row: ``pick_row``."""
    pdl_wait(PDL)
    pick_row(logits, stride, temp, block_max, block_sum, block_raw_max, row_max, uniform, out, V, NB, BLOCK, NB_P2,
             RAW_MAX)


@triton.jit
def _pick_sums_kernel(logits, stride, temp, block_max, block_sum, block_raw_max, uniform, out, warp_sums, V, NB,
                      BLOCK: tl.constexpr, NB_P2: tl.constexpr, K: tl.constexpr, MAIN, TAIL: tl.constexpr,
                      T: tl.constexpr, TS: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 2 and the log-softmax's sums of the same logits in one launch, side by side (both need only pass
    1): program (row, 0) picks the row's token (``pick_row``; first, so that the GPU starts the longer programs
    first), programs (row, 1 + s) are part s of the sum pass (``_triton_log_softmax.sum_part``, the row's max
    from its blocks' raw maxima)."""
    pdl_wait(PDL)
    if tl.program_id(1) == 0:
        pick_row(logits, stride, temp, block_max, block_sum, block_raw_max, block_raw_max, uniform, out, V, NB,
                 BLOCK, NB_P2, False)
    else:
        sum_part(logits, stride, block_raw_max, warp_sums, V, tl.program_id(1) - 1, K, MAIN, TAIL, T, TS, NB, NB_P2)


@triton.jit
def pick_row(logits, stride, temp, block_max, block_sum, block_raw_max, row_max, uniform, out, V, NB,
             BLOCK: tl.constexpr, NB_P2: tl.constexpr, RAW_MAX: tl.constexpr):
    """Row program_id(0): the row's max M (of the block maxima), each block's sum rescaled to M
    (s exp(m - M)), the running sum before each block (a scan in a fixed order) and the total, the first
    block where the running sum passes draw x total (none can, when that product rounds up to the total:
    then the last block with mass, and its last token with mass), and inside it the token, by a cumulative
    sum of its exp(z - M). The blocks' values are one vector: no loop over blocks, no load per block.
    RAW_MAX: also the row's max of the logits (of its blocks' maxima: exact) into ``row_max``."""
    r = tl.program_id(0)
    row = logits + r.to(tl.int64) * stride
    t = tl.load(temp)
    j = tl.arange(0, NB_P2)
    valid = j < NB
    if RAW_MAX:
        tl.store(row_max + r, tl.max(tl.load(block_raw_max + r * NB + j, mask=valid, other=float("-inf")), axis=0))
    bm = tl.load(block_max + r * NB + j, mask=valid, other=float("-inf"))
    mx = tl.max(bm, axis=0)
    bs = tl.where(valid, tl.load(block_sum + r * NB + j, mask=valid, other=0.0) * tl.exp(bm - mx), 0.0)
    shifted = tl.where(j > 0, tl.gather(bs, tl.maximum(j - 1, 0), 0), 0.0)
    run = tl.cumsum(shifted, axis=0)                       # before block j
    reach = run + bs                                       # through block j
    target = tl.load(uniform + r) * element(reach, j, NB - 1)
    blk = tl.min(tl.where((bs > 0) & (reach > target), j, NB_P2), axis=0)  # a block with mass
    last_blk = tl.max(tl.where(valid & (bs > 0), j, -1), axis=0)
    found = blk < NB
    before = element(run, j, blk)
    last_before = element(run, j, last_blk)
    start = tl.where(found, blk, last_blk) * BLOCK
    lane = tl.arange(0, BLOCK)
    offs = start + lane
    z = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / t
    e = tl.where(offs < V, tl.exp(z - mx), 0.0)
    c = tl.where(found, before, last_before) + tl.cumsum(e, axis=0)
    first = tl.min(tl.where((c > target) & (e > 0), lane, BLOCK), axis=0)
    last_nz = tl.max(tl.where(e > 0, lane, -1), axis=0)
    idx = tl.where(found & (first < BLOCK), first, last_nz)
    tl.store(out + r, (start + idx).to(tl.int64))


@triton.jit
def _record_kernel(tok, logp, lp_stride, mx, logsum, slots, nxt, end, tokens, logprobs, tab_stride, stopped, stop,
                   ids, pos, trash, WRITE_TOKENS: tl.constexpr, ADVANCE: tl.constexpr, STATS: tl.constexpr,
                   MP: tl.constexpr = 0, MP_P2: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Row program_id(0) of ``sampling.record_tokens``: integer moves and one fp32 copy (STATS: logp holds the
    logits and the log-prob is (logits[tok] - mx) - logsum, torch's epilogue), nothing else rounded. MP > 0:
    mx / logsum are a ``LogSoftmaxParts``' maxima [B, MP] and warp sums [B, 32], finished here."""
    pdl_wait(PDL)
    i = tl.program_id(0)
    t = tl.load(tok + i)
    n = tl.load(nxt + i)
    slot = tl.load(slots + i)
    col = tl.where(n < tl.load(end + slot), n, trash)
    cell = slot * tab_stride + col
    if WRITE_TOKENS:
        tl.store(tokens + cell, t)
    lp = tl.load(logp + i.to(tl.int64) * lp_stride + t).to(tl.float32)
    if STATS:
        if MP > 0:
            row_mx, row_logsum = finished_stats(mx, logsum, i.to(tl.int64), MP, MP_P2)
        else:
            row_mx, row_logsum = tl.load(mx + i), tl.load(logsum + i)
        lp = (lp - row_mx) - row_logsum
    tl.store(logprobs + cell, lp)
    tl.store(stopped + slot, tl.load(stopped + slot) | (t == tl.load(stop)))
    if ADVANCE:
        tl.store(ids + i, t)
        tl.store(pos + i, n)


@triton.jit
def _step_inputs_kernel(pos, slots, tokens, uniform, tab_stride, slot_ids, seq_lens, nxt, forced, draw, B, max_pos,
                        ids, embed, e_stride, hidden, H, table, t_stride, rows, R, BLOCK: tl.constexpr,
                        HB: tl.constexpr = 1, RB: tl.constexpr = 1, EMBED: tl.constexpr = False,
                        TABLE: tl.constexpr = False, PDL: tl.constexpr = False):
    """``sampling.step_inputs``: programs 0 .. cdiv(B, BLOCK) - 1 the per-row inputs of a block of rows (integer
    moves, a min and two table reads); then (EMBED or TABLE) one program per row r for its gathers: the
    embedding row of token ids[r] into hidden[r] (HB >= H) and row pos[r] of ``table`` into rows[r] (RB >= R),
    copies."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    blocks = tl.cdiv(B, BLOCK)
    if pid < blocks:
        i = pid * BLOCK + tl.arange(0, BLOCK)
        m = i < B
        p = tl.load(pos + i, mask=m, other=0)
        s = tl.load(slots + i, mask=m, other=0)
        n = tl.minimum(p + 1, max_pos)
        cell = s * tab_stride + n
        tl.store(slot_ids + i, s.to(tl.int32), mask=m)
        tl.store(seq_lens + i, (p + 1).to(tl.int32), mask=m)
        tl.store(nxt + i, n, mask=m)
        tl.store(forced + i, tl.load(tokens + cell, mask=m, other=0), mask=m)
        tl.store(draw + i, tl.load(uniform + cell, mask=m, other=0.0), mask=m)
    else:
        r = (pid - blocks).to(tl.int64)
        if EMBED:
            c = tl.arange(0, HB)
            tok = tl.load(ids + r)
            tl.store(hidden + r * H + c, tl.load(embed + tok * e_stride + c, mask=c < H), mask=c < H)
        if TABLE:
            c = tl.arange(0, RB)
            tl.store(rows + r * R + c, tl.load(table + tl.load(pos + r) * t_stride + c, mask=c < R), mask=c < R)
