"""Source checks of every @triton.jit function in minite.kernels: a kernel reads module globals only where
the GPU compiler allows it, and one that can be launched with programmatic dependent launch waits first.
Triton 3.6 raises at compile time on a global that is not a ``tl.constexpr`` (a plain int flag, say), while
the interpreter of the CPU tests reads it without complaint; a PDL kernel that reads before it waits races
only on the GPU: the CPU sees neither bug, so these checks read the source."""
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


def test_pdl_kernels_wait_before_anything_else():
    """A kernel taking the PDL flag may start while the kernel before it still runs: its first statement (after
    the docstring) must be ``pdl_wait(PDL)``, or it could read a buffer not yet written (or write one still
    read). Every kernel of the decode step takes the flag."""
    with_flag = set()
    for mod, jf in _jit_functions():
        if "PDL" not in jf.arg_names or mod.__name__.endswith("_triton_pdl"):
            continue
        with_flag.add(jf.fn.__name__)
        body = ast.parse(textwrap.dedent(inspect.getsource(jf.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and ast.unparse(first.value) == "pdl_wait(PDL)"), f"{mod.__name__}.{jf.fn.__name__}"
    assert {"_cast_kernel", "nvfp4_mm_kernel", "nvfp4_mm_w32_kernel", "invariant_mm_kernel", "_route_kernel",
            "_expert_sort_kernel", "_qk_tail_kernel", "_norm_row_kernel", "decode_f64_kernel",
            "_block_stats_kernel", "_pick_kernel", "_record_kernel", "_step_inputs_kernel", "_sum_part_kernel",
            "_finish_kernel"} <= with_flag
