"""Figures: the per-layer/op localisation heatmap and the cause-attribution waterfall (png + pdf each).

Both read the tidy tables the diagnostics write (layers.csv: layer, op, metric, value; attribution.csv:
cause, order, k3_before, k3_after, delta, share), so they can be redrawn from results without re-running.
Files are written atomically (temporary file, then rename), like every result file.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from minite.provenance import atomic_path  # noqa: E402

#: Execution order of the captured ops inside one decoder layer (columns of the heatmap).
OP_ORDER = ("attn_out", "router_logits", "topk", "moe_out", "residual", "logits")


def save_figure(fig, stem: str | Path, formats=("png", "pdf")) -> list[Path]:
    """Write ``stem.png`` and ``stem.pdf`` atomically; returns the paths."""
    paths = []
    for ext in formats:
        p = Path(f"{stem}.{ext}")
        with atomic_path(p, "wb") as f:
            fig.savefig(f, format=ext, bbox_inches="tight", dpi=150)
        paths.append(p)
    plt.close(fig)
    return paths


def positive_range(tables, metric: str = "rel_err") -> tuple[float, float] | None:
    """(min, max) of the positive finite ``metric`` values over several layers.csv tables (one colour scale
    for several arms' heatmaps); None when none is positive."""
    vals = np.concatenate([t.loc[t["metric"] == metric, "value"].to_numpy(dtype=float) for t in tables] or [[]])
    pos = vals[np.isfinite(vals) & (vals > 0)]
    return (float(pos.min()), float(pos.max())) if pos.size else None


def layer_heatmap(layers: pd.DataFrame, stem: str | Path, metric: str = "rel_err", title: str = "",
                  vrange: tuple[float, float] | None = None) -> list[Path]:
    """Heatmap layer x op of ``metric`` (relative error ||a - b|| / ||b||), log colour scale.

    ``vrange`` fixes the colour scale (``positive_range`` over several arms: the same colour is the same error
    in every arm's heatmap); by default it spans this table's positive values. Exact zeros (bitwise-equal
    engines) cannot sit on a log scale: they are drawn in a separate light colour and annotated "0". The
    final logits appear as a last row labelled "logits".
    """
    d = layers[layers["metric"] == metric]
    if d.empty:
        raise ValueError(f"no rows with metric {metric!r} to plot")
    d = d.assign(row=[("logits" if op == "logits" else str(int(layer)))
                      for layer, op in zip(d["layer"], d["op"], strict=True)])
    ops = [o for o in OP_ORDER if o in set(d["op"])] + sorted(set(d["op"]) - set(OP_ORDER))
    layer_rows = sorted({int(x) for x in d.loc[d["op"] != "logits", "layer"]})
    rows = [str(x) for x in layer_rows] + (["logits"] if (d["op"] == "logits").any() else [])
    grid = d.pivot_table(index="row", columns="op", values="value", aggfunc="first").reindex(index=rows, columns=ops)
    vals = grid.to_numpy(dtype=float)
    vrange = vrange or positive_range([d], metric)
    fig, ax = plt.subplots(figsize=(1.3 * len(ops) + 2.5, 0.45 * len(rows) + 1.8))
    annot = np.vectorize(lambda v: "" if not np.isfinite(v) else ("0" if v == 0 else f"{v:.1e}"))(vals)
    if vrange is not None:
        vmin, vmax = vrange
        norm = LogNorm(vmin=vmin, vmax=vmax if vmax > vmin else vmin * 10)
        with warnings.catch_warnings():  # an all-zero arm on a shared scale: nothing to colour, same colour bar
            warnings.simplefilter("ignore", RuntimeWarning)
            sns.heatmap(grid.where(grid > 0), ax=ax, norm=norm, cmap="rocket_r", annot=annot, fmt="",
                        annot_kws={"size": 7}, cbar_kws={"label": f"{metric} (log scale)"}, linewidths=0.5)
    else:
        sns.heatmap(grid * 0, ax=ax, cmap="Greys", vmin=0, vmax=1, annot=annot, fmt="", cbar=False, linewidths=0.5)
    zeros = np.argwhere(vals == 0)
    for i, j in zeros:  # exact agreement: its own colour
        ax.add_patch(plt.Rectangle((j, i), 1, 1, color="#dff0d8", zorder=0.5))
        if vrange is not None:  # seaborn skips annotations of masked cells
            ax.text(j + 0.5, i + 0.5, "0", ha="center", va="center", fontsize=7)
    ax.set_facecolor("#f5f5f5")
    ax.set_xlabel("op (execution order)")
    ax.set_ylabel("layer")
    ax.set_title(title or f"trainer vs sampler: {metric} per layer and op")
    return save_figure(fig, stem)


def attribution_waterfall(attr: pd.DataFrame, stem: str | Path, title: str = "", metric: str = "k3") -> list[Path]:
    """One waterfall panel per order (forward, reverse, shapley): start at the naive arm's mismatch, one
    floating bar per cause (the mismatch it removes), end at the aligned arm's."""
    orders = [o for o in ("forward", "reverse", "shapley") if o in set(attr["order"])]
    if not orders:
        raise ValueError("attribution table has no forward/reverse/shapley rows")
    fig, axes = plt.subplots(1, len(orders), figsize=(4.6 * len(orders), 4.2), squeeze=False, sharey=True)
    palette = sns.color_palette("deep")
    for ax, order in zip(axes[0], orders, strict=True):
        d = attr[attr["order"] == order].reset_index(drop=True)
        if order == "shapley":  # a waterfall needs a running level: stack Shapley values from the start
            start = float(d["k3_before"].iloc[0])
            levels = start - np.concatenate([[0.0], np.cumsum(d["delta"].to_numpy(float))])
            levels[-1] = float(d["k3_after"].iloc[-1])  # the measured end point, not a rounded running sum
        else:
            levels = np.concatenate([[float(d["k3_before"].iloc[0])], d["k3_after"].to_numpy(float)])
        labels = ["naive"] + list(d["cause"]) + ["aligned"]
        x = np.arange(len(labels))
        ax.bar(x[0], levels[0], color=palette[7])
        for i in range(len(d)):
            lo, hi = sorted((levels[i + 1], levels[i]))
            c = palette[2] if levels[i + 1] <= levels[i] else palette[3]
            ax.bar(x[i + 1], hi - lo, bottom=lo, color=c)
            share = d["share"].iloc[i]
            if np.isfinite(share):
                ax.text(x[i + 1], hi, f"{100 * share:.0f}%", ha="center", va="bottom", fontsize=8)
            ax.plot([x[i] - 0.4, x[i + 1] + 0.4], [levels[i]] * 2, color="0.5", lw=0.6, ls=":")
        ax.bar(x[-1], levels[-1], color=palette[0])
        for i in (0, len(labels) - 1):  # the end points' values (an exact 0 has no visible bar)
            ax.text(x[i], levels[-1 if i else 0], f"{levels[-1 if i else 0]:.2e}", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(order)
        ax.set_ylabel(f"mismatch {metric}")
    fig.suptitle(title or f"{metric}: naive -> aligned, one cause at a time")
    fig.tight_layout()
    return save_figure(fig, stem)
