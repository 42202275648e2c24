"""Building the CUDA kernels (``decode_gemm.cu``, ``decode_attention.cu``) on first use, one rule for both.

Each is a ``torch.utils.cpp_extension.load_inline`` build for the device's compute capability, with entry points
that take pointers and the stream as integers (the binding needs no tensor types). Without nvcc, below the
kernel's architecture, with MINITE_KERNELS_CUDA=0, or when the build fails, ``load`` returns None (a warning
says why, once per kernel and capability) and the callers use the Triton kernels.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

CUDA_ENV = "MINITE_KERNELS_CUDA"  # "0": no CUDA kernels, the Triton ones serve every call


def enabled() -> bool:
    """False when MINITE_KERNELS_CUDA=0."""
    return os.environ.get(CUDA_ENV, "1") != "0"


def arch_flag(cap: tuple[int, int]) -> str:
    major, minor = cap
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"


def load(name: str, source: Path, decl: str, functions: list[str], cap: tuple[int, int],
         min_cap: tuple[int, int], what: str, needs: str):
    """The built extension ``name``_sm<cap> of ``source``, or None (why: warned once by the caller's cache).
    ``what``: the kernel in the warning; ``needs``: the instruction that sets ``min_cap``."""
    if not enabled():
        return None
    if cap < min_cap:
        return _unavailable(what, f"{needs} needs sm_{min_cap[0]}{min_cap[1]} or newer (device is "
                                  f"sm_{cap[0]}{cap[1]})")
    from torch.utils import cpp_extension
    nvcc = Path(cpp_extension.CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
    if not nvcc.exists():
        return _unavailable(what, "no nvcc found (set CUDA_HOME)")
    try:
        return cpp_extension.load_inline(
            name=f"{name}_sm{cap[0]}{cap[1]}", cpp_sources=[decl], cuda_sources=[source.read_text()],
            functions=functions, extra_cuda_cflags=["-O3", arch_flag(cap)], verbose=False)
    except Exception as exc:  # compiler missing pieces, or a build error
        return _unavailable(what, f"build failed ({type(exc).__name__}: {str(exc)[-400:]})")


def _unavailable(what: str, why: str):
    warnings.warn(f"minite.kernels: the CUDA {what} is unavailable: {why}; using the Triton kernels",
                  RuntimeWarning, stacklevel=4)
    return None
