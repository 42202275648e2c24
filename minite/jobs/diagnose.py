"""``python -m minite diagnose``: trainer/sampler mismatch of one arm, localised and attributed.

Writes, into ``--out`` (all files only once everything is computed; each atomically):
    mismatch.json                 k1, k3, chi2, token_mult_prob_error, max_abs_dp, mean_abs_dp, pearson_p,
                                  frac_dlogp_gt_0.1, n_tokens (+ the sequence-level and framework extras of
                                  minite.diagnostics.metrics), first_divergence, settings, provenance
    layers.csv                    tidy per-layer/op comparison (layer, op, metric, value)
    attribution.csv               naive -> aligned, one cause at a time (cause, order, k3_before, k3_after,
                                  delta, share); the same table for every arm (it is about the gap of the
                                  base arm, --attribution-base: naive_te_nvfp4 by default)
    attribution_subsets.csv       every cause subset's full metrics (16 measured arms from naive_te_nvfp4,
                                  32 from naive_te_nvfp4_blanket: minite.diagnostics.attribution)
The figures of these files (layer heatmap, attribution waterfall) are ``python -m minite.report figure ...``.

Prompts: the held-out prompts of the task of ``--rl-config`` (without one: the arithmetic task for
char-tokenizer models, seeded random token prompts for the others; ``minite.tasks.task_for_model``).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from minite.diagnostics.metrics import ATTRIBUTION_NOTE, DEFINITIONS
from minite.jobs import common

log = logging.getLogger(__name__)

# settings an attribution computed by another arm's run must share with this run to be reused
_SAME = ("model", "layers", "checkpoint", "task", "device", "max_new_tokens", "temperature", "seed")
# files of an attribution: an older run's must not sit beside this run's results as if they were its own
ATTRIBUTION_FILES = ("attribution.csv", "attribution_subsets.csv", "attribution_waterfall.png",
                     "attribution_waterfall.pdf")


def add_args(p) -> None:
    common.add_arm(p)
    common.add_model(p)
    common.add_checkpoint(p)
    common.add_rl_config(p, default=None, help="the RL config whose task gives the prompts (default: the "
                         "arithmetic task for char-tokenizer models, random token prompts for the others)")
    common.add_device(p)
    common.add_seed(p)
    p.add_argument("--prompts", type=int, default=16, help="prompts sampled for mismatch + localisation")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--attribution", choices=("on", "off"), default="on",
                   help="run the cause attribution (off: attribution.csv is not written)")
    p.add_argument("--attribution-prompts", type=int, default=8)
    p.add_argument("--attribution-base", default="naive_te_nvfp4", metavar="ARM",
                   help="the arm whose gap to minite_nvfp4 is attributed (default naive_te_nvfp4; "
                        "naive_te_nvfp4_blanket adds the high-precision cause: its trainer quantizes the router)")
    p.add_argument("--attribution-from", default=None, metavar="DIR",
                   help="reuse the attribution another arm's diagnose run computed with the same model, "
                        "checkpoint, task, seed and sampling settings (it does not depend on --arm)")
    common.add_out(p, "dir", help="output directory", marker="mismatch.json")


def _reuse_attribution(src: Path, settings: dict, args):
    """(attribution, subsets, source info) from another run's directory, refusing different settings."""
    import pandas as pd

    from minite.rl.spec import stored_path

    try:
        rec = json.loads((src / "mismatch.json").read_text())
        attr = pd.read_csv(src / "attribution.csv")
        subsets = pd.read_csv(src / "attribution_subsets.csv")
    except (OSError, ValueError) as e:
        raise ValueError(f"--attribution-from {src}: cannot read its attribution ({e})") from None
    theirs = {k: rec.get("settings", {}).get(k) for k in _SAME}
    mine = {k: settings.get(k) for k in _SAME}
    prompts = rec.get("attribution_settings", {}).get("prompts")
    base = rec.get("attribution_settings", {}).get("base", "naive_te_nvfp4")
    if theirs != mine or prompts != args.attribution_prompts or base != args.attribution_base:
        raise ValueError(f"--attribution-from {src}: computed with other settings ({theirs}, prompts "
                         f"{prompts}, base {base}) than this run ({mine}, prompts {args.attribution_prompts}, "
                         f"base {args.attribution_base})")
    return attr, subsets, {"dir": stored_path(src), "provenance": rec.get("provenance")}


def _attributable(arm) -> bool:
    """A naive NVFP4 arm: switching its causes one by one ends exactly at minite_nvfp4, and some cause differs."""
    from minite.diagnostics import attribution as A

    try:
        A.all_causes_arm(arm)
    except (ValueError, AssertionError):
        return False
    return bool(A.active_causes(arm))


def _check_attribution_base(name: str) -> None:
    """Refuse an --attribution-base the attribution cannot start from, naming the shipped arms that can."""
    from minite.engines.arms import load_arm
    from minite.yamlconfig import known_configs

    try:
        base = load_arm(name)
    except ValueError as e:
        raise ValueError(f"--attribution-base: {e}") from None
    if not _attributable(base):
        ok = [a for a in known_configs("arm") if _attributable(load_arm(a))]
        raise ValueError(f"--attribution-base {name}: not a naive NVFP4 arm (its causes switched to minite_nvfp4 "
                         f"one by one must end at minite_nvfp4); arms that qualify: {', '.join(ok)}")


def run(args) -> int:
    from minite.diagnostics.attribution import top_causes
    from minite.diagnostics.localise import ROUNDING_THRESHOLD
    from minite.diagnostics.run import attribution_table, diagnose_arm
    from minite.engines.arms import load_arm
    from minite.engines.models import check_positions
    from minite.provenance import provenance, write_csv, write_json
    from minite.rl.spec import stored_path, warm_start_weights
    from minite.tasks import task_for_model

    arm, model_cfg = load_arm(args.arm), common.model_of(args)
    cfg = common.rl_config_of(args)
    task = task_for_model(cfg["task"] if cfg else None, model_cfg, seed=args.seed)
    ckpt = warm_start_weights(args.checkpoint)
    device = common.device_of(args)
    for name in ("prompts", "max_new_tokens", "attribution_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    check_positions(model_cfg, task.max_prompt_len + args.max_new_tokens,
                    f"the task's longest prompt ({task.max_prompt_len}) + --max-new-tokens "
                    f"({args.max_new_tokens})")
    if args.attribution == "off" and args.attribution_from:
        raise ValueError("--attribution-from reuses an attribution: it needs --attribution on")
    if args.attribution == "on":
        _check_attribution_base(args.attribution_base)
    if ckpt is None and model_cfg.get("checkpoint") is None:
        log.warning("diagnose: no --checkpoint and model %s names none: measuring a seeded RANDOM INIT, whose "
                    "distributions are nearly flat (pass --checkpoint results/<profile>/sft for the warm start)",
                    model_cfg["name"])
    out = Path(args.out)
    settings = {"arm": arm.name, "model": model_cfg["name"], "layers": model_cfg["num_hidden_layers"],
                "checkpoint": stored_path(ckpt) if ckpt else None, "task": task.config(), "device": device,
                "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "seed": args.seed, "rounding_threshold": ROUNDING_THRESHOLD}
    attr = subsets = reused = None
    if args.attribution == "on" and args.attribution_from:  # read (and refuse) before the long diagnosis
        attr, subsets, reused = _reuse_attribution(Path(args.attribution_from), settings, args)
    t0 = time.perf_counter()
    d = diagnose_arm(arm, model_cfg, task, device=device, seed=args.seed, checkpoint=ckpt,
                     n_prompts=args.prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    m = d["metrics"]
    log.info("%s: k3=%.3e k1=%.3e token_mult_prob_error=%.6f n_tokens=%d first divergence: %s", arm.name,
             m["k3"], m["k1"], m["token_mult_prob_error"], m["n_tokens"], d["first_divergence"])
    if args.attribution == "on" and not args.attribution_from:
        attr, subsets = attribution_table(model_cfg, task, device=device, seed=args.seed, checkpoint=ckpt,
                                          n_prompts=args.attribution_prompts, max_new_tokens=args.max_new_tokens,
                                          naive=args.attribution_base,
                                          temperature=args.temperature)
        log.info("top causes of the naive gap (Shapley share of k3): %s",
                 ", ".join(f"{c} {100 * s:.1f}%" for c, s in top_causes(attr)))
    record = {**m, "first_divergence": d["first_divergence"],
              "score_replay_max_abs_diff": d["score_replay_max_abs_diff"],
              "captured": d["captured"], "settings": settings,
              "definitions": DEFINITIONS,
              "wall_s": time.perf_counter() - t0, "provenance": provenance(device)}
    if attr is not None:
        record["attribution_top_causes"] = [{"cause": c, "share": s} for c, s in top_causes(attr)]
        record["attribution_settings"] = {"prompts": args.attribution_prompts, "tokens": "naive sampler",
                                          "metric": "k3", "base": args.attribution_base,
                                          "note": ATTRIBUTION_NOTE}
        if reused is not None:
            record["attribution_source"] = reused
    # tables first, the json last: a crash leaves no mismatch.json that names files of another run
    if attr is not None:
        write_csv(out / "attribution_subsets.csv", subsets)
        write_csv(out / "attribution.csv", attr)
    else:
        for name in ATTRIBUTION_FILES:
            (out / name).unlink(missing_ok=True)
    write_csv(out / "layers.csv", d["layers"])
    write_json(out / "mismatch.json", record)
    log.info("wrote %s/mismatch.json, layers.csv%s", out, ", attribution.csv" if attr is not None else "")
    return 0
