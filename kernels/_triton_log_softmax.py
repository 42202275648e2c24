"""Triton kernel of the log-softmax statistics (contract, order and reference in ``log_softmax``).

torch's T = 1024 threads of a row are the lanes of [T / S] vectors in S programs per row (their sums kept
apart, in torch's order), whatever the programs' own warps: the row's max from the S parts' maxima, then each
part's threads' sums and warp trees, then one program per row adds the 32 warp sums by the block's tree. The
bits do not depend on S. exp / log are libdevice's (numpy's under the interpreter). BF16 / FP16 logits are
widened as they are loaded: the values torch reads from their fp32 copy.

The K float4 chunks of a row are a compile-time count (one build per vocabulary size), unrolled: the loads do not
depend on the sums, so the compiler issues them ahead of the ordered adds. A runtime loop left one load in
flight per thread, whose latency bounded the pass (H200, 64 x 151,936 BF16 logits, the row max given, sums +
finish: 19.2 us as a loop, 8.2 us unrolled; bitwise equal to torch's log-softmax either way).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._backend import interpreter_on
from ._triton_fused_ops import _expf
from ._triton_pdl import pdl_wait
from ._triton_torch_order import element, xor_step

if interpreter_on():
    @triton.jit
    def _logf(x):
        return tl.log(x)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _logf(x):
        return libdevice.log(x)


@triton.jit
def _thread_ids(s, TS: tl.constexpr):
    """torch's threads s TS .. (s + 1) TS - 1: the virtual threads of part s."""
    return s * TS + tl.arange(0, TS)


@triton.jit
def _max_part_kernel(logits, stride, part_max, V, K: tl.constexpr, MAIN, TAIL: tl.constexpr, T: tl.constexpr,
                     TS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row r, part s): the max over the elements of its virtual threads (exact in any order)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    t = _thread_ids(tl.program_id(1), TS)
    vec = t[:, None] * 4 + tl.arange(0, 4)[None, :]      # thread t's float4 of a 4T chunk
    m = tl.full([TS, 4], float("-inf"), tl.float32)
    for k in tl.static_range(K):
        m = tl.maximum(m, tl.load(row + k * 4 * T + vec).to(tl.float32))
    mt = tl.full([TS], float("-inf"), tl.float32)
    for i in tl.static_range(TAIL):
        offs = MAIN + i * T + t
        mt = tl.maximum(mt, tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32))
    tl.store(part_max + r * tl.num_programs(1) + tl.program_id(1), tl.maximum(tl.max(tl.max(m, axis=1), axis=0),
                                                                              tl.max(mt, axis=0)))


@triton.jit
def _row_max(part_max, r, MP: tl.constexpr, MP_P2: tl.constexpr):
    """Row r's max: of its MP entries of ``part_max`` (MP_P2: the power of two >= MP)."""
    j = tl.arange(0, MP_P2)
    return tl.max(tl.load(part_max + r * MP + j, mask=j < MP, other=float("-inf")), axis=0)


@triton.jit
def _sum_part_kernel(logits, stride, part_max, warp_sums, V, K: tl.constexpr, MAIN, TAIL: tl.constexpr,
                     T: tl.constexpr, TS: tl.constexpr, MP: tl.constexpr, MP_P2: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Program (row r, part s): ``sum_part``."""
    pdl_wait(PDL)
    sum_part(logits, stride, part_max, warp_sums, V, tl.program_id(1), K, MAIN, TAIL, T, TS, MP, MP_P2)


@triton.jit
def sum_part(logits, stride, part_max, warp_sums, V, s, K: tl.constexpr, MAIN, TAIL: tl.constexpr,
             T: tl.constexpr, TS: tl.constexpr, MP: tl.constexpr, MP_P2: tl.constexpr):
    """Row r = program_id(0), part s: each of its virtual threads' sum of exp(x - max)
    in torch's order (the float4 vectors, each one's four in order, then the tail), then each warp's shuffle
    tree; lane 0 of each of its TS / 32 warps goes to ``warp_sums`` (the row's 32 warp sums, in warp order).
    The max: of the row's MP entries of ``part_max`` (the S parts' maxima, a given row max: MP = 1, or any
    maxima whose max is the row's, such as the sampler's block maxima)."""
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    t = _thread_ids(s, TS)
    vec = t[:, None] * 4 + tl.arange(0, 4)[None, :]
    mx = _row_max(part_max, r, MP, MP_P2)
    acc = tl.zeros([TS], tl.float32)
    for k in tl.static_range(K):
        e = _expf(tl.load(row + k * 4 * T + vec).to(tl.float32) - mx)
        e02, e13 = tl.split(tl.reshape(e, [TS, 2, 2]))
        e0, e2 = tl.split(e02)
        e1, e3 = tl.split(e13)
        acc = (((acc + e0) + e1) + e2) + e3
    for i in tl.static_range(TAIL):
        offs = MAIN + i * T + t
        acc = acc + tl.where(offs < V, _expf(tl.load(row + offs, mask=offs < V, other=0.0).to(tl.float32) - mx), 0.0)
    lane = tl.arange(0, TS)
    for j in tl.static_range(5):                           # each warp's tree (partners stay in the warp)
        acc = xor_step(acc, lane, 16 >> j)
    w = tl.reshape(acc, [TS // 32, 32])
    col = tl.arange(0, 32)
    warps = tl.sum(tl.where(col[None, :] == 0, w, 0.0), axis=1)  # lane 0 of each warp, exactly
    tl.store(warp_sums + r * 32 + s * (TS // 32) + tl.arange(0, TS // 32), warps)


@triton.jit
def _finish_kernel(part_max, warp_sums, mx_out, logsum_out, MP: tl.constexpr, MP_P2: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Row program_id(0): ``finished_stats``."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    mx, logsum = finished_stats(part_max, warp_sums, r, MP, MP_P2)
    tl.store(mx_out + r, mx)
    tl.store(logsum_out + r, logsum)


@triton.jit
def finished_stats(part_max, warp_sums, r, MP: tl.constexpr, MP_P2: tl.constexpr):
    """Row r's (max, log-sum): the max of its MP maxima in ``part_max``, the log of its 32 warp sums added by
    the block's tree (the statistics' last pass)."""
    col = tl.arange(0, 32)
    warps = tl.load(warp_sums + r * 32 + col)
    for j in tl.static_range(5):
        warps = xor_step(warps, col, 16 >> j)
    return _row_max(part_max, r, MP, MP_P2), _logf(element(warps, col, 0))
