"""Source checks of every @triton.jit function in minite.kernels: a kernel reads module globals only where
the GPU compiler allows it. Triton 3.6 raises at compile time on a global that is not a ``tl.constexpr``
(a plain int flag, say), while the interpreter of the CPU tests reads it without complaint: only the GPU
would see the bug, so this check runs on the CPU."""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import minite.kernels
import triton.language as tl


def _jit_functions():
    for info in pkgutil.iter_modules(minite.kernels.__path__):
        mod = importlib.import_module(f"minite.kernels.{info.name}")
        for obj in vars(mod).values():
            if inspect.isfunction(getattr(obj, "fn", None)) and obj.fn.__module__ == mod.__name__:
                yield mod, obj


def _global_reads(fn) -> set[str]:
    """Names the function loads that it neither takes as parameters nor assigns itself."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local


def _allowed(value) -> bool:
    return (isinstance(value, (types.ModuleType, tl.constexpr)) or hasattr(value, "fn")
            or value in (tl.constexpr,))


def test_jit_functions_read_only_constexpr_globals():
    fns = list(_jit_functions())
    assert len(fns) > 40 and {"_cast_kernel", "decode_f64_kernel", "_silu_mul_kernel"} <= {f.fn.__name__
                                                                                         for _, f in fns}
    bad = []
    for mod, f in fns:
        for name in _global_reads(f.fn):
            if name in vars(mod):
                if not _allowed(vars(mod)[name]):
                    bad.append(f"{mod.__name__}.{f.fn.__name__}: {name} = {vars(mod)[name]!r}")
            elif not hasattr(builtins, name):
                bad.append(f"{mod.__name__}.{f.fn.__name__}: {name} is not defined")
    assert not bad, bad


FLAG = 1  # a plain int global, as the kernel modules' flag constants are


def _reads_flag(x):
    return x + FLAG


def test_the_check_reports_a_plain_int_global():
    assert _global_reads(_reads_flag) == {"FLAG"} and not _allowed(FLAG) and _allowed(tl.constexpr(1))
