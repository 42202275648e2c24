"""``python -m minite export-modelopt``: write the ModelOpt-NVFP4 checkpoint an arm's sampler serves.

Builds the policy (local checkpoint or seeded random init) on the arm's trainer, ships it to the arm's
sampler through the sync API, calibrates static activation scales on the task's calibration prompts (the
task of ``--rl-config``; without one, ``minite.tasks.task_for_model``'s default for the model), and writes the
directory vLLM loads (``minite.engines.modelopt_export``). Nothing is left half-written on error.
"""
from __future__ import annotations

import logging

from minite.jobs import common

log = logging.getLogger(__name__)



def add_args(p) -> None:
    common.add_arm(p, required=False, default="naive_te_nvfp4",
                   help="an arm with an NVFP4 sampler (naive_te_nvfp4 = what ModelOpt writes from BF16 weights; "
                        "minite_nvfp4 = the trainer's codes)")
    common.add_model(p)
    common.add_checkpoint(p)
    common.add_rl_config(p, default=None, help="the RL config whose task gives the calibration prompts "
                         "(default: the model's default task)")
    common.add_seed(p)
    p.add_argument("--calib-prompts", type=int, default=32, help="calibration prompts")
    common.add_out(p, "dir", help="output directory", marker="export_provenance.json")


def run(args) -> int:
    import torch

    from minite.engines.arms import load_arm
    from minite.engines.modelopt_export import export_modelopt
    from minite.engines.sampler import Sampler
    from minite.engines.trainer import Trainer
    from minite.rl.spec import warm_start_weights
    from minite.tasks import task_for_model

    if args.calib_prompts < 1:
        raise ValueError(f"--calib-prompts must be >= 1, got {args.calib_prompts}")
    arm = load_arm(args.arm)
    if not arm.sampler.is_nvfp4:
        raise ValueError(f"arm {arm.name} has a BF16 sampler; choose an NVFP4 arm (naive_te_nvfp4 or minite_nvfp4)")
    cfg, rl_cfg = common.model_of(args), common.rl_config_of(args)
    task = task_for_model(rl_cfg["task"] if rl_cfg else None, cfg, seed=args.seed)
    torch.manual_seed(args.seed)
    sampler = Sampler(arm, cfg, device="cpu")
    trainer = Trainer(arm, cfg, device="cpu", seed=args.seed, checkpoint=warm_start_weights(args.checkpoint))
    sampler.load_weights(trainer.export_weights())
    sampler.calibrate(task.calibration_prompts(args.calib_prompts))
    out = export_modelopt(sampler, cfg, args.out, arm=arm)
    log.info("wrote ModelOpt NVFP4 checkpoint to %s", out)
    return 0
