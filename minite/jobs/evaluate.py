"""``python -m minite eval``: held-out mean@k accuracy of an arm's sampler at each checkpoint of a run.

Writes one CSV (atomically): arm, step, k, mean_at_k, pass_at_k, n_prompts, temperature, sha, device, date.
See ``minite.rl.evaluate``.
"""
from __future__ import annotations

from minite.rl.cli_args import add_common, fail, load_common


def add_args(p) -> None:
    p.add_argument("--arm", required=True, help="bf16 | naive_te_nvfp4 | minite_nvfp4 (or an arm YAML)")
    add_common(p)
    p.add_argument("--run", required=True, help="the stability run directory (python -m minite rl --out)")
    p.add_argument("--init", default=None, help="warm start for step 0 (default: the run's run.json)")
    p.add_argument("--steps", type=int, nargs="*", default=None, help="only these checkpoint steps")
    p.add_argument("--out", required=True, help="output CSV path")


def run(args) -> int:
    from minite.engines.arms import load_arm
    from minite.rl.evaluate import evaluate_run

    try:
        arm = load_arm(args.arm)
        model_cfg, cfg, task, device = load_common(args)
        df = evaluate_run(arm, model_cfg, cfg, task, args.run, args.out, init=args.init, seed=args.seed,
                          device=device, steps=args.steps, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        return fail("eval", e)
    print(df[["arm", "step", "k", "mean_at_k", "pass_at_k", "n_prompts"]].to_string(index=False))
    print(f"eval {arm.name}: wrote {args.out}")
    return 0
