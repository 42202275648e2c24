"""Triton kernel of the log-softmax statistics (contract, order and reference in ``log_softmax``).

One program per row; torch's T = 1024 threads are the lanes of [T] vectors (their sums kept apart, in
torch's order), whatever the program's own warps. exp / log are libdevice's (numpy's under the interpreter).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._backend import interpreter_on
from ._triton_fused_ops import _expf
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
def _stats_kernel(logits, stride, mx_out, logsum_out, V, K, MAIN, TAIL: tl.constexpr, T: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    t = tl.arange(0, T)
    vec = t[:, None] * 4 + tl.arange(0, 4)[None, :]      # thread t's float4 of a 4T chunk
    m = tl.full([T, 4], float("-inf"), tl.float32)         # the max: exact in any order
    for k in range(K):
        m = tl.maximum(m, tl.load(row + k * 4 * T + vec))
    mt = tl.full([T], float("-inf"), tl.float32)
    for i in tl.static_range(TAIL):
        offs = MAIN + i * T + t
        mt = tl.maximum(mt, tl.load(row + offs, mask=offs < V, other=float("-inf")))
    mx = tl.maximum(tl.max(tl.max(m, axis=1), axis=0), tl.max(mt, axis=0))

    acc = tl.zeros([T], tl.float32)
    for k in range(K):                                     # the vectors, each one's four in order
        e = _expf(tl.load(row + k * 4 * T + vec) - mx)
        e02, e13 = tl.split(tl.reshape(e, [T, 2, 2]))
        e0, e2 = tl.split(e02)
        e1, e3 = tl.split(e13)
        acc = (((acc + e0) + e1) + e2) + e3
    for i in tl.static_range(TAIL):                        # then the tail, one element per thread a round
        offs = MAIN + i * T + t
        acc = acc + tl.where(offs < V, _expf(tl.load(row + offs, mask=offs < V, other=0.0) - mx), 0.0)
    for j in tl.static_range(5):                           # each warp's tree
        acc = xor_step(acc, t, 16 >> j)
    w = tl.reshape(acc, [32, 32])
    col = tl.arange(0, 32)
    warps = tl.sum(tl.where(col[None, :] == 0, w, 0.0), axis=1)  # lane 0 of each warp, exactly
    for j in tl.static_range(5):                           # the warp sums' tree
        warps = xor_step(warps, col, 16 >> j)
    tl.store(mx_out + r, mx)
    tl.store(logsum_out + r, _logf(element(warps, col, 0)))
