"""The repository's top-level kernels/ is minite.kernels; imported as a top-level ``kernels`` (the repository
root on sys.path: ``python -m`` run from there) it stands aside for Hugging Face's package of that name, which
transformers imports, instead of shadowing it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *path, site: bool = False) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``path`` first on sys.path; without ``site``, isolated (-I -S: no
    site-packages, so an installed Hugging Face ``kernels`` stays out of it)."""
    prefix = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}; "
    flags = [] if site else ["-I", "-S"]
    return subprocess.run([sys.executable, *flags, "-c", prefix + code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_top_level_kernels_is_hugging_faces_package_where_installed(tmp_path):
    hf = tmp_path / "site" / "kernels"
    hf.mkdir(parents=True)
    (hf / "__init__.py").write_text("MARK = 'hf'\nfrom kernels.layer import X\n")
    (hf / "layer.py").write_text("X = 1\n")
    r = _run("import kernels; print(kernels.MARK, kernels.X, kernels.__file__)", ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stderr
    mark, x, where = r.stdout.split()
    assert (mark, x) == ("hf", "1") and Path(where).parent == hf


def test_top_level_kernels_is_an_empty_namespace_without_it():
    """No file and no version: transformers (< 5.25 probes an undeclared package by importing it) counts it
    absent, and nothing of minite.kernels is imported a second time under that name."""
    r = _run("import kernels; print(getattr(kernels, '__file__', None), hasattr(kernels, '__version__'), "
             "kernels.__path__, any(m.startswith('kernels.') for m in sys.modules)); from kernels import gemm", ROOT)
    assert r.stdout.split() == ["None", "False", "[]", "False"]
    assert r.returncode != 0 and "cannot import name 'gemm' from 'kernels'" in r.stderr


def test_minite_kernels_is_the_repository_directory():
    r = _run("import minite.kernels as k; print(callable(k.nvfp4_gemm), k.__file__)", ROOT, site=True)
    assert r.returncode == 0, r.stderr
    ok, where = r.stdout.split()
    assert ok == "True" and Path(where).parent == ROOT / "kernels"
