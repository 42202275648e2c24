"""``python -m minite sft``: the SFT warm start on the task (cached; every arm's RL run starts from it).

A second call with the same model / task / SFT config / seed finds ``<out>/sft.json`` with the same hash
and does nothing. See ``minite.rl.sft``.
"""
from __future__ import annotations

import logging

from minite.jobs import common

log = logging.getLogger(__name__)

DISTRIBUTED = True      # runs under torchrun: the FSDP2 trainer, each rank on its rows (minite.rl.sft)


def add_args(p) -> None:
    common.add_model(p)
    common.add_rl_config(p)
    common.add_device(p)
    common.add_seed(p)
    common.add_progress(p)
    common.add_out(p, "dir", required=False, help="output directory (default: results/<rl-config>/sft)",
                   marker="sft.json")
    p.add_argument("--force", action="store_true", help="retrain even if the cache matches")


def run(args) -> int:
    from minite.rl.sft import run_sft

    spec = common.run_spec(args)
    out = args.out or f"results/{common.rl_config_name(args)}/sft"
    info = run_sft(spec.model_cfg, spec.cfg, spec.task, out, seed=spec.seed, device=spec.device,
                   progress=not args.no_progress, force=args.force)
    if info["cache_hit"]:
        log.info("sft: cache hit (%s/sft.json, hash %s); nothing to do", out, info["config_hash"])
    else:
        a, b = info["heldout_before"], info["heldout_after"]
        log.info("sft: %d steps in %.1fs; held-out expected accuracy %.4f -> %.4f (greedy-certain %.3f); "
                 "wrote %s/sft.json", info["steps"], info["seconds"], a["expected_acc"], b["expected_acc"],
                 b["greedy_certain"], out)
    return 0
