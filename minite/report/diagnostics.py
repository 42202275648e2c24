"""Diagnostics figures for the pipeline: the diagnostics helper's own heatmap and waterfall
(minite.diagnostics.figures), drawn from the files the diagnose job wrote, with per-arm titles."""
from __future__ import annotations

from minite.report.load import ResultError

#: the arm whose attribution (naive -> aligned, one cause at a time) the waterfall shows when several have one
ATTRIBUTION_ARM = "naive_te_nvfp4"


def layers(diag: dict[str, dict], arm: str, out_stem):
    from minite.diagnostics.figures import layer_heatmap
    d = diag.get(arm, {})
    if "layers" not in d or d["layers"].empty:
        raise ResultError(f"no per-layer diagnostics for arm {arm!r} (diagnostics/layers.csv missing or empty)")
    return layer_heatmap(d["layers"], out_stem, title=f"{arm}: trainer vs sampler, relative error per layer/op")


def attribution(diag: dict[str, dict], out_stem):
    from minite.diagnostics.figures import attribution_waterfall
    have = [a for a, d in diag.items() if "attribution" in d and not d["attribution"].empty]
    if not have:
        raise ResultError("no arm has a non-empty diagnostics/attribution.csv")
    arm = ATTRIBUTION_ARM if ATTRIBUTION_ARM in have else have[0]
    return attribution_waterfall(diag[arm]["attribution"], out_stem)
