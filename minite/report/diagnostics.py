"""Diagnostics figures for the pipeline: the layer heatmaps and the attribution waterfall of
minite.diagnostics.figures, drawn from the files the diagnose job wrote, with per-arm titles."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from minite.report.load import ResultError

#: the arm whose attribution (naive -> aligned, one cause at a time) the waterfall shows when several have one
ATTRIBUTION_ARM = "naive_te_nvfp4"


def layers(diag: dict[str, dict], out_stem, arms=None) -> dict[str, list]:
    """One heatmap per arm (``<out_stem>_<arm>.png/.pdf``), every one on the colour scale of all of them, so
    that the same colour is the same relative error in every arm. Returns arm -> written paths."""
    arms = list(arms or diag)
    missing = [a for a in arms if "layers" not in diag.get(a, {}) or diag[a]["layers"].empty]
    if missing:
        raise ResultError(f"no per-layer diagnostics for arm(s) {missing} (diagnostics/layers.csv missing or empty)")
    from minite.diagnostics.figures import layer_heatmap, positive_range
    vrange = positive_range([diag[a]["layers"] for a in arms])
    stem = Path(out_stem)
    return {a: layer_heatmap(diag[a]["layers"], stem.with_name(f"{stem.name}_{a}"), vrange=vrange,
                             title=f"{a}: trainer vs sampler, relative error per layer/op\n(one colour scale for "
                                   f"{', '.join(arms)})") for a in arms}


def attribution(diag: dict[str, dict], out_stem):
    from minite.diagnostics.figures import attribution_waterfall
    have = [a for a, d in diag.items() if "attribution" in d and not d["attribution"].empty]
    if not have:
        raise ResultError("no arm has a non-empty diagnostics/attribution.csv")
    arm = ATTRIBUTION_ARM if ATTRIBUTION_ARM in have else have[0]
    return attribution_waterfall(diag[arm]["attribution"], out_stem, title=attribution_title(diag[arm]["mismatch"]))


def attribution_title(mismatch: dict) -> str:
    """The waterfall's title: the tokens its k3 is measured on, which are not mismatch.json's."""
    att = (mismatch.get("attribution_settings") or {}).get("prompts")
    own = (mismatch.get("settings") or {}).get("prompts")
    where = f"{att} prompts" if att else "its own prompts"
    other = f" ({own} prompts, each arm's own tokens)" if own else ""
    return (f"k3: naive -> aligned, one cause at a time, on the naive sampler's tokens for {where};\n"
            f"not comparable with mismatch.json's k3{other}")


def definitions_table(mismatch: dict | None = None, keys=None) -> pd.DataFrame:
    """The metric definitions (formula, better, units, threshold) a mismatch.json carries, or the current
    ones (minite.diagnostics.metrics.DEFINITIONS) for files written before they were embedded."""
    from minite.diagnostics.metrics import DEFINITIONS
    defs = (mismatch or {}).get("definitions")
    defs = defs if isinstance(defs, dict) else DEFINITIONS
    rows = {k: v for k, v in defs.items() if keys is None or k in keys}
    return pd.DataFrame.from_dict(rows, orient="index").reindex(
        columns=["formula", "better", "units", "threshold", "threshold_meaning", "source"])
