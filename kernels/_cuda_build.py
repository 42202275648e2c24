"""Building the CUDA kernels (``decode_gemm.cu``, ``decode_attention.cu``) on first use, one rule for both.

Each is a ``torch.utils.cpp_extension.load_inline`` build for the device's compute capability, with entry points
that take pointers and the stream as integers (the binding needs no tensor types). Without nvcc, below the
kernel's architecture, with MINITE_KERNELS_CUDA=0, or when the build fails, ``load`` returns None (a warning
says why, once per kernel and capability) and the callers use the Triton kernels.

Interrupted builds. torch serialises builds of one extension with a plain file (``<build dir>/lock``): a build
killed before it ends leaves it behind, and every later build of that extension waits on it forever. So the
builds here first take an OS lock of their own on the build directory (``flock``: it dies with its holder);
whoever holds it knows that no live build of this package owns torch's lock file, and removes a stale one.

Shared pieces. A kernel file's ``#include "<name>.cuh"`` of a header beside it (``cuda_common.cuh``) is pasted
in before the build (``source_text``): load_inline hashes the source text it is given, so a change to the
header rebuilds every extension that includes it.
"""
from __future__ import annotations

import contextlib
import os
import re
import warnings
from pathlib import Path

CUDA_ENV = "MINITE_KERNELS_CUDA"  # "0": no CUDA kernels, the Triton ones serve every call


def enabled() -> bool:
    """False when MINITE_KERNELS_CUDA=0."""
    return os.environ.get(CUDA_ENV, "1") != "0"


def arch_flag(cap: tuple[int, int]) -> str:
    major, minor = cap
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.M)


def source_text(source: Path) -> str:
    """``source`` with each ``#include "<name>.cuh"`` of a header beside it replaced by the header's text."""
    return _LOCAL_INCLUDE.sub(lambda m: (source.parent / m.group(1)).read_text(), source.read_text())


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
    ext = f"{name}_sm{cap[0]}{cap[1]}"
    try:
        build_dir = Path(cpp_extension._get_build_directory(ext, verbose=False))
        with build_guard(build_dir):
            return cpp_extension.load_inline(
                name=ext, cpp_sources=[decl], cuda_sources=[source_text(source)], functions=functions,
                extra_cuda_cflags=["-O3", arch_flag(cap)], build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # compiler missing pieces, or a build error
        return _unavailable(what, f"build failed ({type(exc).__name__}: {str(exc)[-400:]})")


@contextlib.contextmanager
def build_guard(build_dir: Path):
    """Hold this package's OS lock on ``build_dir`` (waiting for a live build to end) and remove torch's lock
    file if one is there: no live build of ours owns it (module docstring)."""
    import fcntl
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "minite_build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            stale = build_dir / "lock"
            if stale.exists():
                warnings.warn(f"minite.kernels: removing {stale}, left by a build that was interrupted",
                              RuntimeWarning, stacklevel=3)
                stale.unlink(missing_ok=True)
            yield build_dir
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unavailable(what: str, why: str):
    warnings.warn(f"minite.kernels: the CUDA {what} is unavailable: {why}; using the Triton kernels",
                  RuntimeWarning, stacklevel=4)
    return None
