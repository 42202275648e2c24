"""Optional Transformer Engine backend for the trainer (``trainer.gemm: te``) — for Blackwell GPUs.

UNTESTED HERE: the development machines have no Transformer Engine and no FP4 tensor cores (H200 is Hopper;
TE's NVFP4 recipe needs sm_100+). It is kept deliberately thin so what it does is easy to audit:
    - the q/k/v/o projections (and lm_head when the arm quantizes it) become ``te.pytorch.Linear``
      modules holding the same weights (same parameter names: ``...q_proj.weight``); a quantized router keeps
      minite's NVFP4 router (``quant_linear.make_router``, emulated GEMM);
    - every trainer forward runs under TE's autocast with ``NVFP4BlockScaling()`` — TE's default NVFP4 recipe
      (16x16 weight tiles, 1x16 activations, SR + RHT on gradients), i.e. what the naive arm emulates;
    - the MoE experts keep minite's own NVFP4 grouped path (``minite.engines.experts``): mapping the 3D HF
      expert parameters onto ``te.pytorch.GroupedLinear`` is not wired (it would need one weight per expert).
Install (builds against your torch): ``pip install --no-build-isolation "transformer_engine[pytorch]"``.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def require_te():
    """Import transformer_engine.pytorch or raise a clear error."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        from transformer_engine.common import recipe  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "trainer gemm 'te' needs NVIDIA Transformer Engine (pip install --no-build-isolation "
            "'transformer_engine[pytorch]'; Blackwell GPU for NVFP4). Use gemm 'emulated' or 'kernel' "
            f"otherwise. Import failed: {e}") from None
    if not hasattr(recipe, "NVFP4BlockScaling"):
        raise RuntimeError("this Transformer Engine has no NVFP4BlockScaling recipe (needs TE >= 2.8)")
    return te


def nvfp4_recipe():
    """TE's default NVFP4 recipe object."""
    require_te()
    from transformer_engine.common import recipe
    return recipe.NVFP4BlockScaling()


def te_linear(lin: nn.Module) -> nn.Module:
    """A ``te.pytorch.Linear`` holding ``lin``'s weight (bias-free, BF16 params)."""
    te = require_te()
    w = lin.weight
    out = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=torch.bfloat16, device=w.device)
    with torch.no_grad():
        out.weight.copy_(w)
    return out


def autocast(recipe_obj=None):
    """TE's quantized-compute context (``te.pytorch.autocast`` in new TE, ``fp8_autocast`` in older)."""
    te = require_te()
    recipe_obj = recipe_obj or nvfp4_recipe()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe_obj)
    if hasattr(te, "fp8_autocast"):
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe_obj)
    return contextlib.nullcontext()
