"""``python -m minite rl``: a long-horizon GRPO stability run of one arm (checkpoints, resumable).

Rerunning the same command after a kill resumes from the newest checkpoint (``<out>/ckpt/``) and produces
the same curve; a larger ``--steps`` extends a finished run. Writes ``<out>/stability.jsonl`` (one line per
step), ``<out>/stability_summary.json`` (drift alarm step, collapse step, lead, final reward, provenance) and
``<out>/run.json``. See ``minite.rl.stability``. Under torchrun (several GPUs) each process runs a sampler
replica and a shard of the learner, and rank 0 writes the same files.
"""
from __future__ import annotations

import logging

from minite.jobs import common

log = logging.getLogger(__name__)

DISTRIBUTED = True      # runs under torchrun: data-parallel rollouts, the FSDP2 learner (minite.rl.stability)
RESUMES = True          # a rerun continues from the newest checkpoint (the interrupted message says so)


def add_args(p) -> None:
    common.add_arm(p)
    common.add_model(p)
    common.add_rl_config(p)
    common.add_device(p)
    common.add_seed(p)
    common.add_progress(p)
    p.add_argument("--steps", type=int, required=True, help="total GRPO steps (counting resumed ones)")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every k steps (default: config)")
    common.add_checkpoint(p, help="warm start: an SFT directory (python -m minite sft) or a local HF checkpoint")
    common.add_out(p, "dir", required=False, help="output directory (default: results/<rl-config>/<arm>)",
                   marker="run.json")


def run(args) -> int:
    from minite.engines.arms import load_arm
    from minite.rl.stability import run_stability

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.ckpt_every is not None and args.ckpt_every < 1:
        raise ValueError(f"--ckpt-every must be >= 1, got {args.ckpt_every}")
    spec = common.run_spec(args, load_arm(args.arm))
    out = args.out or f"results/{common.rl_config_name(args)}/{spec.arm.name}"
    s = run_stability(spec, out, args.steps, ckpt_every=args.ckpt_every, progress=not args.no_progress)
    log.info("rl %s: %d steps; final reward %s, alarm step %s, collapse step %s, lead %s; wrote %s/"
             "stability_summary.json", spec.arm.name, s["steps"], s["final_reward"], s["alarm_step"],
             s["collapse_step"], s["lead_steps"], out)
    return 0
