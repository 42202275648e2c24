"""minite: reproducible experiments for native NVFP4 (W4A4) RL — BF16 vs naive TE NVFP4 vs miniTE-aligned.

Subpackages: ``minite.nvfp4`` (format + quantizers), ``minite.kernels`` (Triton W4A4 GEMMs; source in the
top-level ``kernels/`` directory), ``minite.engines`` (trainer + sampler per arm), ``minite.diagnostics``,
``minite.align``, ``minite.rl``, ``minite.jobs`` (what ``python -m minite <job>`` runs).
"""
import os as _os

__version__ = "0.1.0"

# minite.kernels is the top-level kernels/ directory. Installed, setuptools maps it (package-dir); run from a
# source checkout without installing, let the import system find it beside this package.
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "kernels")):
    _root = _os.path.dirname(_here)
    if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
        __path__.append(_root)  # noqa: F821  (package __path__)
