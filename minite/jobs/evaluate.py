"""``python -m minite eval``: held-out mean@k accuracy of an arm's sampler at each checkpoint of a run.

Writes one CSV (atomically): arm, step, k, mean_at_k, pass_at_k, n_prompts, temperature, sha, device, date.
See ``minite.rl.evaluate``.
"""
from __future__ import annotations

import logging

from minite.jobs import common

log = logging.getLogger(__name__)

DISTRIBUTED = True      # runs under torchrun: each rank's sampler replica answers a share of the prompts


def add_args(p) -> None:
    common.add_arm(p)
    common.add_model(p)
    common.add_rl_config(p)
    common.add_device(p)
    common.add_seed(p)
    common.add_progress(p)
    p.add_argument("--run-dir", "--run", dest="run", required=True,
                   help="the stability run directory (python -m minite rl --out); spell it --run-dir under torchrun, "
                        "whose own parser takes --run for an abbreviation of its --run-path")
    common.add_checkpoint(p, help="warm start for step 0 (default: the one the run's run.json names)")
    p.add_argument("--steps", type=int, nargs="*", default=None, help="only these checkpoint steps")
    common.add_out(p, "file", help="output CSV path")


def run(args) -> int:
    from minite.engines.arms import load_arm
    from minite.rl.evaluate import evaluate_run

    spec = common.run_spec(args, load_arm(args.arm))
    df = evaluate_run(spec, args.run, args.out, steps=args.steps, progress=not args.no_progress)
    table = df[["arm", "step", "k", "mean_at_k", "pass_at_k", "n_prompts"]].to_string(index=False)
    log.info("eval %s: wrote %s\n%s", spec.arm.name, args.out, table)
    return 0
