"""Device-side MoE bookkeeping in one launch each: the grouped GEMM's tile schedule and the wgrad operands'
padded token layout. Each was ~10-13 PyTorch ops per call (cumsum, searchsorted, gathers, a scatter), so a
few hundred microseconds of host time per call on a learner whose update is bound by its host.

Both work from the expert offsets alone (int32 or int64, E + 1 entries, sorted): every program recomputes the
per-expert counts and their prefix sums (E is small: 128 for Qwen3-30B-A3B), then finds the segment of each of
its positions by counting the segment ends at or below it (``searchsorted(..., right=True)``). Integer
arithmetic only: the results equal the PyTorch formulas they replace element for element (the tests hold
them to ``gemm._tile_schedule_torch`` and ``experts._padded_layout_torch``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_pdl import pdl_wait


@triton.jit
def tile_schedule_kernel(off_ptr, expert_ptr, row_ptr, n_valid_ptr, E, bound, BM: tl.constexpr,
                         BE: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr = False):
    """Row tiles of BM rows per expert, valid ones first: slot i -> (expert or -1, first row); n_valid."""
    pdl_wait(PDL)
    e = tl.arange(0, BE)
    live = e < E
    lo = tl.load(off_ptr + e, mask=live, other=0).to(tl.int64)
    hi = tl.load(off_ptr + e + 1, mask=live, other=0).to(tl.int64)
    tiles = (tl.maximum(hi - lo, 0) + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    starts = ends - tiles
    if tl.program_id(0) == 0:
        tl.store(n_valid_ptr, tl.sum(tiles, 0))
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    ex = tl.sum(((ends[None, :] <= i[:, None]) & live[None, :]).to(tl.int32), 1)
    exc = tl.minimum(ex, E - 1)
    pick = e[None, :] == exc[:, None]
    first_tile = tl.sum(tl.where(pick, starts[None, :], 0), 1)
    first_row = tl.sum(tl.where(pick, lo[None, :], 0), 1)
    row = first_row + (i - first_tile) * BM
    keep = i < bound
    tl.store(expert_ptr + i, tl.where(ex < E, exc, -1).to(tl.int32), mask=keep)
    tl.store(row_ptr + i, row.to(tl.int32), mask=keep)


@triton.jit
def padded_layout_kernel(off_ptr, src_ptr, pends_ptr, E, width, ALIGN: tl.constexpr, FILL: tl.constexpr,
                         BE: tl.constexpr, BP: tl.constexpr):
    """Each expert's token segment zero-padded to a multiple of ALIGN (FILL: at least ALIGN): padded position
    p -> its source row, or -1 for a zero token; the padded segment ends (FILL: the last one at ``width``)."""
    e = tl.arange(0, BE)
    live = e < E
    lo = tl.load(off_ptr + e, mask=live, other=0)
    counts = tl.load(off_ptr + e + 1, mask=live, other=0) - lo
    pcounts = (counts + ALIGN - 1) // ALIGN * ALIGN
    if FILL:
        pcounts = tl.where(live, tl.maximum(pcounts, ALIGN), 0)
    pends = tl.cumsum(pcounts, 0)
    if tl.program_id(0) == 0:
        if FILL:
            pends_out = tl.where(e == E - 1, width, pends)
        else:
            pends_out = pends
        tl.store(pends_ptr + e, pends_out.to(tl.int32), mask=live)
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    seg = tl.sum(((pends[None, :] <= p[:, None]) & live[None, :]).to(tl.int32), 1)
    pick = e[None, :] == seg[:, None]
    local = p - tl.sum(tl.where(pick, pends - pcounts, 0), 1)
    row = tl.sum(tl.where(pick, lo, 0), 1) + local
    real = (seg < E) & (local < tl.sum(tl.where(pick, counts, 0), 1))
    tl.store(src_ptr + p, tl.where(real, row, -1).to(tl.int32), mask=p < width)
