"""The first statement of a kernel launched with programmatic dependent launch (``_backend.pdl_meta``)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished and its writes are visible (before
    any load or store: nothing here reads or writes ahead of it, so no buffer is raced), then let the next
    kernel's programs take SMs as they free up. Every program passes here, so a kernel's end still implies the
    end of every kernel before it (the next kernel's wait covers them all)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
