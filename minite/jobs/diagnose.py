"""``python -m minite diagnose``: trainer/sampler mismatch of one arm, localised and attributed.

Writes, into ``--out`` (all files only once everything is computed; each atomically):
    mismatch.json                 k1, k3, chi2, token_mult_prob_error, max_abs_dp, mean_abs_dp, pearson_p,
                                  frac_dlogp_gt_0.1, n_tokens (+ the sequence-level and framework extras of
                                  minite.diagnostics.metrics), first_divergence, settings, provenance
    layers.csv                    tidy per-layer/op comparison (layer, op, metric, value)
    attribution.csv               naive -> aligned, one cause at a time (cause, order, k3_before, k3_after,
                                  delta, share); the same table for every arm (it is about the naive gap)
    attribution_subsets.csv       every cause subset's full metrics (the 32 measured arms)
    layers_heatmap.{png,pdf}, attribution_waterfall.{png,pdf}
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from minite.diagnostics.attribution import top_causes
from minite.diagnostics.localise import ROUNDING_THRESHOLD
from minite.diagnostics.metrics import ATTRIBUTION_NOTE, DEFINITIONS
from minite.engines.arms import ArmError, load_arm
from minite.provenance import provenance, write_csv, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arm", required=True, help="arm name (configs/arms) or YAML path")
    p.add_argument("--model", default="tiny", help="model config name (configs/models) or YAML path")
    p.add_argument("--checkpoint", default=None, help="local HF checkpoint dir or SFT output dir (default: "
                   "the model config's checkpoint, else seeded random init)")
    p.add_argument("--num-layers", type=int, default=None, help="depth override (real-architecture slices)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=16, help="prompts sampled for mismatch + localisation")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attribution", choices=("on", "off"), default="on",
                   help="run the 32-arm cause attribution (off: attribution.csv is not written)")
    p.add_argument("--attribution-prompts", type=int, default=8)
    p.add_argument("--attribution-from", default=None, metavar="DIR",
                   help="reuse the attribution another arm's diagnose run computed with the same model, "
                        "checkpoint, seed and sampling settings (it does not depend on --arm)")
    p.add_argument("--out", required=True, help="output directory")


def _checkpoint(path):
    if path is None:
        return None
    from minite.rl.common import init_weights_path  # accepts an SFT dir (sft.json + weights/) or a checkpoint
    return str(init_weights_path(path))


_SAME = ("model", "layers", "checkpoint", "device", "max_new_tokens", "temperature", "seed")


ATTRIBUTION_FILES = ("attribution.csv", "attribution_subsets.csv", "attribution_waterfall.png",
                     "attribution_waterfall.pdf")


def _reuse_attribution(src: Path, settings: dict, args):
    """(attribution, subsets, source info) from another run's directory, refusing different settings."""
    import json

    import pandas as pd
    try:
        rec = json.loads((src / "mismatch.json").read_text())
        attr = pd.read_csv(src / "attribution.csv")
        subsets = pd.read_csv(src / "attribution_subsets.csv")
    except (OSError, ValueError) as e:
        raise ValueError(f"--attribution-from {src}: cannot read its attribution ({e})") from None
    theirs = {k: rec.get("settings", {}).get(k) for k in _SAME}
    mine = {k: settings.get(k) for k in _SAME}
    prompts = rec.get("attribution_settings", {}).get("prompts")
    if theirs != mine or prompts != args.attribution_prompts:
        raise ValueError(f"--attribution-from {src}: computed with other settings ({theirs}, prompts "
                         f"{prompts}) than this run ({mine}, prompts {args.attribution_prompts})")
    return attr, subsets, {"dir": str(src), "provenance": rec.get("provenance")}


def run(args) -> int:
    from minite.diagnostics import figures
    from minite.diagnostics.run import attribution_table, diagnose_arm
    from minite.engines.models import load_model_config

    try:
        arm = load_arm(args.arm)
        model_cfg = load_model_config(args.model, num_layers=args.num_layers)
        ckpt = _checkpoint(args.checkpoint)
    except (ArmError, ValueError, FileNotFoundError) as e:
        print(f"diagnose: {e}", file=sys.stderr)
        return 2
    for name in ("prompts", "max_new_tokens", "attribution_prompts"):
        if getattr(args, name) < 1:
            print(f"diagnose: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    out = Path(args.out)
    settings = {"arm": arm.name, "model": model_cfg["name"], "layers": model_cfg["num_hidden_layers"],
                "checkpoint": ckpt, "device": args.device, "prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
                "rounding_threshold": ROUNDING_THRESHOLD}
    t0 = time.perf_counter()
    d = diagnose_arm(arm, model_cfg, device=args.device, seed=args.seed, checkpoint=ckpt, n_prompts=args.prompts,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    m = d["metrics"]
    print(f"{arm.name}: k3={m['k3']:.3e} k1={m['k1']:.3e} token_mult_prob_error={m['token_mult_prob_error']:.6f} "
          f"n_tokens={m['n_tokens']} first divergence: {d['first_divergence']}")
    attr = subsets = reused = None
    if args.attribution == "on" and args.attribution_from:
        try:
            attr, subsets, reused = _reuse_attribution(Path(args.attribution_from), settings, args)
        except ValueError as e:
            print(f"diagnose: {e}", file=sys.stderr)
            return 2
    elif args.attribution == "on":
        attr, subsets = attribution_table(model_cfg, device=args.device, seed=args.seed, checkpoint=ckpt,
                                          n_prompts=args.attribution_prompts, max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature)
        top = top_causes(attr)
        print("top causes of the naive gap (Shapley share of k3): "
              + ", ".join(f"{c} {100 * s:.1f}%" for c, s in top))
    record = {**m, "first_divergence": d["first_divergence"],
              "score_replay_max_abs_diff": d["score_replay_max_abs_diff"],
              "captured": d["captured"], "settings": settings,
              "definitions": DEFINITIONS,
              "wall_s": time.perf_counter() - t0, "provenance": provenance(args.device)}
    if attr is not None:
        record["attribution_top_causes"] = [{"cause": c, "share": s} for c, s in top_causes(attr)]
        record["attribution_settings"] = {"prompts": args.attribution_prompts, "tokens": "naive sampler",
                                          "metric": "k3", "note": ATTRIBUTION_NOTE}
        if reused is not None:
            record["attribution_source"] = reused
    # figures first (they can fail on odd data); tables and the json last, so a crash leaves no partial set
    figures.layer_heatmap(d["layers"], out / "layers_heatmap",
                          title=f"{arm.name} ({model_cfg['name']}): relative error, trainer vs sampler")
    if attr is not None:
        figures.attribution_waterfall(attr, out / "attribution_waterfall",
                                      title=f"{model_cfg['name']}: naive -> aligned k3, one cause at a time")
        write_csv(out / "attribution_subsets.csv", subsets)
        write_csv(out / "attribution.csv", attr)
    else:  # an older run's attribution must not sit beside this run's results as if it were one of them
        for name in ATTRIBUTION_FILES:
            (out / name).unlink(missing_ok=True)
    write_csv(out / "layers.csv", d["layers"])
    write_json(out / "mismatch.json", record)
    print(f"wrote {out}/mismatch.json, layers.csv" + (", attribution.csv" if attr is not None else ""))
    return 0
