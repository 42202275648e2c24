"""``python -m minite rl``: a long-horizon GRPO stability run of one arm (checkpoints, resumable).

Rerunning the same command after a kill resumes from the newest checkpoint (``<out>/ckpt/``) and produces
the same curve; a larger ``--steps`` extends a finished run. Writes ``<out>/stability.jsonl`` (one line per
step), ``<out>/stability_summary.json`` (drift alarm step, collapse step, lead, final reward, provenance) and
``<out>/run.json``. See ``minite.rl.stability``.
"""
from __future__ import annotations

from minite.rl.cli_args import add_common, fail, load_common


def add_args(p) -> None:
    p.add_argument("--arm", required=True, help="bf16 | naive_te_nvfp4 | minite_nvfp4 (or an arm YAML)")
    add_common(p)
    p.add_argument("--steps", type=int, required=True, help="total GRPO steps (counting resumed ones)")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every k steps (default: config)")
    p.add_argument("--init", default=None, help="warm start: an SFT dir (python -m minite sft) or HF checkpoint")
    p.add_argument("--out", default=None, help="output directory (default: results/<rl-config>/<arm>)")


def run(args) -> int:
    from minite.engines.arms import load_arm
    from minite.rl.stability import run_stability

    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        if args.ckpt_every is not None and args.ckpt_every < 1:
            raise ValueError(f"--ckpt-every must be >= 1, got {args.ckpt_every}")
        arm = load_arm(args.arm)
        model_cfg, cfg, task, device = load_common(args)
        out = args.out or f"results/{args.rl_config}/{arm.name}"
        s = run_stability(arm, model_cfg, cfg, task, out, steps=args.steps, init=args.init, seed=args.seed,
                          device=device, ckpt_every=args.ckpt_every, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        return fail("rl", e)
    print(f"rl {arm.name}: {s['steps']} steps; final reward {s['final_reward']}, alarm step {s['alarm_step']}, "
          f"collapse step {s['collapse_step']}, lead {s['lead_steps']}; wrote {out}/stability_summary.json")
    return 0
