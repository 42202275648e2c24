"""Shared flags and loading for the sft / rl / eval jobs (the RL profile config, model, task, threads)."""
from __future__ import annotations

import sys


def add_common(p, model_default: str = "tiny") -> None:
    p.add_argument("--model", default=model_default, help="tiny | small | qwen3_30b_a3b (or a model YAML)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (full-width depth slice)")
    p.add_argument("--rl-config", "--profile", dest="rl_config", default="cpu",
                   help="RL profile (configs/rl/<name>.yaml: cpu | h200 | b300) or a YAML path")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (YAML syntax), e.g. --set rl.lr=1e-5; repeatable")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def load_common(args):
    """(model_cfg, cfg, task, device) from parsed flags; raises ValueError-family errors on bad input."""
    import torch
    import yaml

    from minite.engines.models import load_model_config
    from minite.rl.config import load_rl_config
    from minite.rl.task import build_task

    overrides = {}
    for s in args.set:
        key, eq, val = s.partition("=")
        if not eq:
            raise ValueError(f"--set {s!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = yaml.safe_load(val)
    cfg = load_rl_config(args.rl_config, overrides)
    model_cfg = load_model_config(args.model, num_layers=args.layers)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but no CUDA GPU is available")
    tokenizer = None
    if model_cfg.get("tokenizer") not in (None, "char"):
        from minite.rl.math_task import load_hf_tokenizer
        tokenizer = load_hf_tokenizer(model_cfg["tokenizer"])
    task = build_task(cfg["task"], seed=args.seed, tokenizer=tokenizer)
    return model_cfg, cfg, task, device


def fail(job: str, e: BaseException) -> int:
    print(f"{job}: error: {e}", file=sys.stderr)
    return 2
