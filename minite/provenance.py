"""Provenance and atomic writes: every result file carries (or sits beside) git sha, device, command, date
and the versions of the software that measured it.

One writer per file, and no half-written results: everything goes to a temporary file in the same
directory and is renamed into place only when complete, with the mode a plain ``open()`` would give it.
Paths stored in results are relative to the repository (``repo_relative``), never the machine's.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

#: The checkout this package runs from (an editable install: the repository root).
REPO_ROOT = Path(__file__).resolve().parent.parent


def git_sha(short: bool = False) -> str:
    """The checkout's commit (with '-dirty' when tracked files have changes), or 'unknown' outside git.

    MINITE_GIT_SHA, when set, wins: a tree copied to another machine (e.g. an offline GPU node) can carry a
    stale .git whose HEAD is not the commit that was copied."""
    if os.environ.get("MINITE_GIT_SHA"):
        return os.environ["MINITE_GIT_SHA"]
    root = REPO_ROOT
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("MINITE_GIT_SHA", "unknown")
    sha = sha[:12] if short else sha
    return sha + ("-dirty" if dirty else "")


def device_name(device: str | torch.device | None = None) -> str:
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev if dev is not None and dev.index is not None else 0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def repo_relative(path: str | os.PathLike) -> str:
    """``path`` relative to the repository when it lies inside it (what results store), else as given."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def gpu_driver() -> str | None:
    """The NVIDIA driver version (nvidia-ml-py), or None without a GPU / NVML."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # ImportError, NVMLError: the driver version is informative, never required
        return None


def provenance(device=None, command: list[str] | str | None = None) -> dict:
    """The provenance block every result carries: sha, device, command, date and the software versions
    (torch, triton, Python; on a GPU the CUDA runtime torch was built for and the driver, else None)."""
    if command is None:
        command = [Path(sys.argv[0]).name if sys.argv[0] else "python"] + sys.argv[1:]
        if sys.argv and sys.argv[0].endswith("__main__.py"):
            command = ["python", "-m", "minite"] + sys.argv[1:]
    if not isinstance(command, str):
        command = shlex.join(command)
    out = {
        "sha": git_sha(),
        "device": device_name(device),
        "command": command,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
    }
    dev = torch.device(device) if device is not None else None
    on_gpu = (dev is None or dev.type == "cuda") and torch.cuda.is_available()
    out.update(cuda=torch.version.cuda if on_gpu else None, gpu_driver=gpu_driver() if on_gpu else None)
    return out


def _file_mode() -> int:
    """The mode open() gives a new file: 0666 less the process umask (mkstemp alone gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: str = "w"):
    """Yield a temporary file object beside ``path``; rename it over ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path, fix: str = "restore or delete it", error: type[Exception] = ValueError):
    """A JSON file minite wrote (a result, a run's or checkpoint's state, a warm start's config). A torn or
    hand-edited one raises ``error`` in one line naming the file and ``fix`` (json's own message names none)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: corrupt JSON ({e}); {fix}") from None


def write_json(path, obj, indent: int = 2) -> None:
    with atomic_path(path) as f:
        json.dump(obj, f, indent=indent, default=_json_default)
        f.write("\n")


def write_text(path, text: str) -> None:
    with atomic_path(path) as f:
        f.write(text)


def write_csv(path, df) -> None:
    """Write a pandas DataFrame atomically (no index)."""
    with atomic_path(path) as f:
        df.to_csv(f, index=False)


def append_jsonl(path, record: dict) -> None:
    """Append one JSON line and fsync (the stability log: a killed job loses at most the line in flight)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return repo_relative(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")
