"""The flags the jobs share, spelled once, and what they load.

    --arm ARM             a shipped arm (configs/arms/), or an arm YAML
    --model MODEL         a shipped model (configs/models/), or a model YAML
    --layers N            decoder layers kept (a full-width depth slice)
    --device DEV          cuda | cuda:N | cpu (default: cuda when available)
    --seed N
    --checkpoint DIR      the weights to start from: an SFT directory (python -m minite sft) or a local HF
                          checkpoint (default: the model config's checkpoint, else a seeded random init)
    --out PATH            where the job writes
    --rl-config NAME      RL config (configs/rl/<name>.yaml) or a YAML path; with
    --set SEC.KEY=VALUE   overrides of single values (repeatable)
    --no-progress         no progress bar
    --torch-profile CSV   torch.profiler table of one more learner update (bench-learner) or generate (bench-sampler)

Older spellings still run, hidden from --help: --init (= --checkpoint), --num-layers (= --layers),
--profile (= --rl-config).
"""
from __future__ import annotations

import argparse
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


def add_out(p, *, required: bool = True, help: str = "output path") -> None:
    p.add_argument("--out", required=required, default=None, help=help)


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


# ----------------------------------------------------------------------------------------------- loading
def device_of(args) -> str:
    """--device, resolved: cuda when available unless given; cuda without a GPU is a ValueError."""
    import torch

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
        overrides[key.strip()] = yaml.safe_load(val)
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
