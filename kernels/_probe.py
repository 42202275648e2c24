"""First-use probes: a faster kernel config is used only once it has been run on this GPU beside the safe
config and given bitwise the same output (batch invariance rests on every config taking the same reduction
order; that is checked, not assumed). Verdicts are cached per (what, device)."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch

_verdicts: dict = {}  # (key, device index) -> bool


def proven(key: Hashable, device: torch.device, probe: Callable[[], bool]) -> bool:
    """``probe()`` -> True when the candidate's output is bitwise equal to the safe one. Cached; False (use the
    safe config) while a CUDA graph is being captured and not yet probed, or when the probe raises (a config
    that does not fit this GPU or does not compile here)."""
    full = (key, device.index)
    if full in _verdicts:
        return _verdicts[full]
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    try:
        ok = bool(probe())
    except Exception as exc:  # OutOfResources (shared memory), a compiler failure on this GPU's Triton
        warnings.warn(f"minite.kernels: config {key} unusable here ({type(exc).__name__}: {str(exc)[:200]}); "
                      "using the safe config", RuntimeWarning, stacklevel=3)
        ok = False
    _verdicts[full] = ok
    return ok


def verdicts(prefix: str = "") -> dict:
    """{key: verdict} for the probes run so far in this process (keys whose str starts with ``prefix``)."""
    return {k: v for (k, _), v in _verdicts.items() if str(k).startswith(prefix)}
