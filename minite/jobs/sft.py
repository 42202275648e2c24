"""``python -m minite sft``: the SFT warm start on the task (cached; every arm's RL run starts from it).

A second call with the same model / task / SFT config / seed finds ``<out>/sft.json`` with the same hash
and does nothing. See ``minite.rl.sft``.
"""
from __future__ import annotations

from minite.rl.cli_args import add_common, fail, load_common


def add_args(p) -> None:
    add_common(p)
    p.add_argument("--out", default=None, help="output directory (default: results/<rl-config>/sft)")
    p.add_argument("--force", action="store_true", help="retrain even if the cache matches")


def run(args) -> int:
    from minite.rl.sft import run_sft

    try:
        model_cfg, cfg, task, device = load_common(args)
        out = args.out or f"results/{args.rl_config}/sft"
        info = run_sft(model_cfg, cfg, task, out, seed=args.seed, device=device,
                       progress=not args.no_progress, force=args.force)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        return fail("sft", e)
    if info["cache_hit"]:
        print(f"sft: cache hit ({out}/sft.json, hash {info['config_hash']}); nothing to do")
    else:
        a, b = info["heldout_before"], info["heldout_after"]
        print(f"sft: {info['steps']} steps in {info['seconds']:.1f}s; held-out expected accuracy "
              f"{a['expected_acc']:.4f} -> {b['expected_acc']:.4f} (greedy-certain {b['greedy_certain']:.3f}); "
              f"wrote {out}/sft.json")
    return 0
