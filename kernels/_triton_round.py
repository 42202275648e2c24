"""Output rounding shared by the attention and BF16 GEMM kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x -> fp32 -> dtype, both round-to-nearest-even: the two roundings torch's ``.to(bfloat16)`` of a float64
    tensor makes (one when x is fp32). bf16 is rounded on the fp32 bits (NaN kept NaN) because the Triton
    interpreter's own fp32 -> bf16 cast truncates, and the CPU tests compare bits."""
    x = x.to(tl.float32)
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
