"""Backend choice for minite.kernels: Triton (GPU, or CPU under TRITON_INTERPRET=1) or pure PyTorch.

Rules (one place, so every entry point agrees):
    backend=None/"auto"  MINITE_KERNELS_BACKEND if set, else Triton for CUDA tensors (when Triton imports)
                         and PyTorch for CPU tensors (the engines call us on CPU too and must stay fast).
    backend="triton"     Triton; CPU tensors run under the interpreter (TRITON_INTERPRET=1 must be set before
                         triton is imported; tests/conftest.py does that on machines without CUDA).
    backend="torch"      the pure-PyTorch path.
Without Triton everything falls back to PyTorch; an explicit "triton" request then warns once, clearly.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

BACKENDS = ("auto", "triton", "torch")
PDL_ENV = "MINITE_KERNELS_PDL"  # "0": launch every kernel without programmatic dependent launch


@functools.lru_cache(maxsize=1)
def triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(backend: str | None, device: torch.device) -> str:
    """'triton' or 'torch' for tensors on ``device``."""
    if backend is None:
        backend = os.environ.get("MINITE_KERNELS_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    ok, why = triton_available()
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (device.type == "cuda" and ok) else "torch"
    # explicit triton
    if not ok:
        _warn_once(f"minite.kernels: backend='triton' requested but Triton is not importable ({why}); "
                   "using the pure-PyTorch path")
        return "torch"
    if device.type == "cpu" and not interpreter_on():
        raise RuntimeError("minite.kernels: backend='triton' on CPU tensors needs the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported (or use backend='torch')")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"minite.kernels: no Triton path for device {device}")
    return "triton"


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, (0, 0) for CPU (kept as a function so tests can mock it)."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with programmatic dependent launch (PDL, sm_90+): a kernel's
    programs may start while the previous kernel in the stream finishes, and wait (``griddepcontrol.wait``)
    until its writes are visible before they read or write anything a kernel writes. It hides the launch gap
    between the short kernels of a decode step, CUDA graphs included; the values are those of a plain launch.
    Off on CPU, under the interpreter, and with MINITE_KERNELS_PDL=0."""
    return (device.type == "cuda" and not interpreter_on() and os.environ.get(PDL_ENV, "1") != "0"
            and capability(device) >= (9, 0))


def pdl_meta(kernel, device: torch.device) -> dict:
    """The launch arguments that turn PDL on for a Triton ``kernel`` taking the ``PDL`` constexpr (its first
    statement: ``_triton_pdl.pdl_wait(PDL)``), where ``pdl_on(device)``; {} otherwise (a plain launch)."""
    if "PDL" in getattr(kernel, "arg_names", ()) and pdl_on(device):
        return {"PDL": True, "launch_pdl": True}
    return {}


def kernel_math(name: str, x: torch.Tensor) -> torch.Tensor:
    """fp32 ``exp`` / ``log`` as the Triton kernels compute them: CUDA's expf / logf on the GPU (what torch
    calls too), numpy's on CPU (the interpreter's; torch's CPU versions can differ from it in the last bit).
    For the PyTorch emulations that serve as those kernels' references."""
    if x.device.type == "cuda":
        return getattr(torch, name)(x)
    import numpy as np

    return torch.from_numpy(getattr(np, name)(x.numpy()))


def shuffle_tree(v: torch.Tensor, tree: str = "halves") -> torch.Tensor:
    """Lane 0's value after a warp shuffle tree over the last dim of v (a power of two of lanes): "halves"
    adds lane l + W/2 to lane l, then + W/4, .. (offsets decreasing), "pairs" adds adjacent lanes first
    (offsets increasing). The PyTorch form of the trees the Triton kernels take in torch's orders
    (``_triton_torch_order``), for their emulations."""
    if tree not in ("halves", "pairs"):
        raise ValueError(f"tree must be 'halves' or 'pairs', not {tree!r}")
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:] if tree == "halves" else v[..., 0::2] + v[..., 1::2]
    return v[..., 0]
