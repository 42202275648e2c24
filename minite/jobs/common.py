"""The flags the jobs share, spelled once, and what they load.

    --arm ARM             a shipped arm (configs/arms/), or an arm YAML
    --model MODEL         a shipped model (configs/models/), or a model YAML
    --layers N            decoder layers kept (a full-width depth slice)
    --device DEV          cuda | cuda:N | cpu (default: cuda when available)
    --seed N
    --checkpoint DIR      the weights to start from: an SFT directory (python -m minite sft) or a local HF
                          checkpoint (default: the model config's checkpoint, else a seeded random init)
    --out PATH            where the job writes (a file or a directory, checked before any work: check_outputs)
    --rl-config NAME      RL config (configs/rl/<name>.yaml) or a YAML path; with
    --set SEC.KEY=VALUE   overrides of single values (repeatable)
    --no-progress         no progress bar
    --torch-profile CSV   torch.profiler table of one more learner update (bench-learner) or generate (bench-sampler)

Older spellings still run, hidden from --help: --init (= --checkpoint), --num-layers (= --layers),
--profile (= --rl-config).
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from minite.yamlconfig import known_configs

RL_CONFIG_DEFAULT = "cpu"


def _old_spelling(p: argparse.ArgumentParser, flag: str, dest: str, **kw) -> None:
    p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)


def add_arm(p, *, required: bool = True, default: str | None = None, help: str | None = None) -> None:
    p.add_argument("--arm", required=required, default=default,
                   help=help or f"{' | '.join(known_configs('arm'))} (or an arm YAML)")


def add_model(p, default: str = "tiny") -> None:
    p.add_argument("--model", default=default, help=f"{' | '.join(known_configs('model'))} (or a model YAML)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (full-width depth slice)")
    _old_spelling(p, "--num-layers", "layers", type=int)


def add_device(p) -> None:
    p.add_argument("--device", default=None, help="cuda | cuda:N | cpu (default: cuda when available)")


def add_seed(p) -> None:
    p.add_argument("--seed", type=int, default=0)


def add_checkpoint(p, help: str = "weights to start from: an SFT directory or a local HF checkpoint "
                                  "(default: the model config's checkpoint, else a seeded random init)") -> None:
    p.add_argument("--checkpoint", default=None, metavar="DIR", help=help)
    _old_spelling(p, "--init", "checkpoint")


#: The file that marks each directory job's output (rl, sft, diagnose, export-modelopt): a directory --out
#: holding another job's marker, or a file --out named like one, is another job's output and is refused.
OUTPUT_MARKERS = ("run.json", "sft.json", "mismatch.json", "export_provenance.json")


def add_out(p, kind: str, *, required: bool = True, help: str = "output path", marker: str | None = None) -> None:
    """--out, and what ``check_outputs`` needs to know of it: ``kind`` 'file' or 'dir'; a directory job's
    ``marker`` (one of OUTPUT_MARKERS), the file that makes a directory its output."""
    p.add_argument("--out", required=required, default=None, help=help)
    declare_out(p, kind, marker=marker)


def declare_out(p, kind: str, *, marker: str | None = None) -> None:
    """``add_out``'s record alone, for a job whose --out another module defines (kernel-bench)."""
    if kind not in ("file", "dir") or (marker is not None and marker not in OUTPUT_MARKERS):
        raise ValueError(f"--out: kind 'file' or 'dir' and a marker of OUTPUT_MARKERS, got {kind!r}, {marker!r}")
    p.set_defaults(_out_kind=kind, _out_marker=marker,
                   _out_refuses=tuple(m for m in OUTPUT_MARKERS if m != marker))


def add_rl_config(p, default: str | None = RL_CONFIG_DEFAULT, help: str | None = None) -> None:
    p.add_argument("--rl-config", dest="rl_config", default=default,
                   help=help or f"RL config ({' | '.join(known_configs('rl'))}) or a YAML path")
    _old_spelling(p, "--profile", "rl_config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one RL config value (YAML syntax), e.g. --set rl.lr=1e-5; repeatable")


def add_progress(p) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_torch_profile(p, what: str) -> None:
    p.add_argument("--torch-profile", dest="torch_profile", default=None, metavar="CSV",
                   help=f"after the timed run, profile one more {what} with torch.profiler and write its ops "
                        "to this CSV (minite.jobs.profiling)")


# ----------------------------------------------------------------------------------------------- outputs
def check_outputs(args) -> None:
    """Refuse, before any work, an --out (and --torch-profile) the job could not write or must not write:
    a benchmark or diagnosis would otherwise fail only when it writes, at the end. ValueError, one line."""
    if args.out is not None:
        _check_path("--out", Path(args.out), args._out_kind)
        _check_markers(Path(args.out), args._out_kind, args._out_marker, args._out_refuses)
    if getattr(args, "torch_profile", None):
        _check_path("--torch-profile", Path(args.torch_profile), "file")


def _check_path(flag: str, p: Path, kind: str) -> None:
    from minite.provenance import REPO_ROOT

    # the same notion as the pipeline's (workflow/rules/common.smk): results/reference/ of the checkout
    if p.resolve().is_relative_to((REPO_ROOT / "results" / "reference").resolve()):
        raise ValueError(f"{flag} {p}: results/reference/ holds the committed reference runs and is read-only; "
                         "write elsewhere")
    if p.exists() and p.is_dir() != (kind == "dir"):
        is_, want = ("directory", "file") if p.is_dir() else ("file", "directory")
        raise ValueError(f"{flag} {p}: is a {is_}, expected a {want}")
    anc = next(a for a in ((p,) if kind == "dir" else ()) + tuple(p.parents) if a.exists())
    if not anc.is_dir():
        raise ValueError(f"{flag} {p}: {anc} is a file, not a directory")
    try:  # really try: os.access says yes to root, also where it cannot write (read-only or immutable dirs)
        fd, probe = tempfile.mkstemp(dir=anc, prefix=".minite-write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot write in {anc} ({e.strerror})") from None


def _check_markers(p: Path, kind: str, marker: str | None, refuses: tuple[str, ...]) -> None:
    """Another job's output is no place for this job's: its files would mix, or one would replace the other."""
    if kind == "file" and p.name in refuses:
        raise ValueError(f"--out {p}: {p.name} is the marker file of another job's output directory")
    found = [m for m in refuses if (p / m).exists()] if kind == "dir" and p.is_dir() else []
    if found:
        own = f"; this job writes into an empty directory or one holding its own {marker}" if marker else ""
        raise ValueError(f"--out {p}: holds {found[0]}, another job's output{own}")


# ----------------------------------------------------------------------------------------------- loading
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_of(args) -> str:
    """--device, resolved: cuda when available unless given; cuda without a GPU, or a device minite does not
    run on (torch's own error for those is a long dispatcher dump), is a ValueError."""
    import torch

    if args.device is not None and not DEVICE.fullmatch(args.device):
        raise ValueError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA GPU is available")
    if torch.device(device).index is not None:
        # cuda:N (a pipeline placing runs on the GPUs of a machine): N becomes the current device, so every
        # kernel launch and CUDA graph of the job is on the GPU its tensors are on
        torch.cuda.set_device(torch.device(device))
    return device


def model_of(args) -> dict:
    from minite.engines.models import load_model_config
    return load_model_config(args.model, num_layers=args.layers)


def rl_config_of(args) -> dict | None:
    """The RL config of --rl-config with the --set overrides; None when neither is given."""
    import yaml

    from minite.rl.config import load_rl_config

    if args.rl_config is None and not args.set:
        return None
    overrides = {}
    for s in args.set:
        key, eq, val = s.partition("=")
        if not eq:
            raise ValueError(f"--set {s!r}: expected SECTION.KEY=VALUE")
        try:
            overrides[key.strip()] = yaml.safe_load(val)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {s!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    return load_rl_config(args.rl_config or RL_CONFIG_DEFAULT, overrides)


def rl_config_name(args) -> str:
    """The RL config's name for default output directories: results/<name>/..."""
    return Path(args.rl_config or RL_CONFIG_DEFAULT).stem


def run_spec(args, arm=None):
    """The ``minite.rl.spec.RunSpec`` the flags describe (arm, model, RL config, task, checkpoint, seed,
    device); ``arm`` None for the arm-less SFT warm start."""
    from minite.rl.spec import RunSpec
    from minite.tasks import task_for_model

    cfg, model_cfg = rl_config_of(args), model_of(args)
    task = task_for_model(cfg["task"], model_cfg, seed=args.seed)
    return RunSpec(arm=arm, model_cfg=model_cfg, cfg=cfg, task=task, init=getattr(args, "checkpoint", None),
                   seed=args.seed, device=device_of(args))
