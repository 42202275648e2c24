"""Seaborn figures of the results (each written as ``<stem>.png`` and ``<stem>.pdf``).

They plot what the loaders (minite.report.load) return and compute nothing but rolling means for display.
Each arm keeps one colour across all figures. With ``out_stem=None`` a function returns the open figure
instead of writing files (what the notebooks display inline).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:          # files only, never a display (a notebook keeps its inline backend)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from minite.provenance import atomic_path  # noqa: E402
from minite.report.load import ResultError, column  # noqa: E402

ARM_COLORS = {"bf16": "#4d4d4d", "naive_te_nvfp4": "#d62728", "minite_nvfp4": "#2ca02c",
              "naive_te_nvfp4_tis": "#ff7f0e", "naive_te_nvfp4_blanket": "#9467bd"}
ARM_LABELS = {"bf16": "BF16", "naive_te_nvfp4": "naive TE NVFP4", "minite_nvfp4": "miniTE NVFP4",
              "naive_te_nvfp4_tis": "naive TE NVFP4 + TIS", "naive_te_nvfp4_blanket": "naive TE NVFP4 (blanket)"}


def palette(arms) -> dict:
    extra = iter(sns.color_palette("tab10"))
    return {a: ARM_COLORS.get(a) or next(extra) for a in arms}


def save(fig, out_stem, footer: str | None = None):
    """Write ``out_stem``.png and .pdf atomically, with an optional provenance footer, and close the figure;
    with ``out_stem=None`` return the figure instead."""
    if footer:
        fig.text(0.995, 0.005, footer, ha="right", va="bottom", fontsize=6, color="0.45")
    if out_stem is None:
        return fig
    out_stem = Path(out_stem)
    paths = []
    for ext in ("png", "pdf"):
        path = out_stem.with_name(out_stem.name + "." + ext)
        with atomic_path(path, "wb") as f:
            fig.savefig(f, format=ext, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def footer_from(records) -> str | None:
    """'minite <sha> · <device>' from result records that carry provenance (one line per distinct pair)."""
    pairs = sorted({(str(r.get("sha", "?"))[:12], str(r.get("device", "?"))) for r in records
                    if isinstance(r, dict) and ("sha" in r or "device" in r)})
    return "; ".join(f"minite {s} · {d}" for s, d in pairs) or None


def throughput_bars(table: pd.DataFrame, out_stem=None, footer: str | None = None):
    """Learner tokens/s per arm (the throughput table), each bar labelled with its ratio to BF16."""
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    arms = list(table["arm"])
    sns.barplot(data=table, x="arm", y="tokens_per_s", hue="arm", palette=palette(arms), legend=False,
                ax=ax, order=arms)
    for i, r in enumerate(table.itertuples()):
        label = f"{r.tokens_per_s:,.0f}"
        if not (isinstance(r.ratio_vs_bf16, float) and math.isnan(r.ratio_vs_bf16)):
            label += f"\n{r.ratio_vs_bf16:.2f}x BF16"
        ax.annotate(label, (i, r.tokens_per_s), ha="center", va="bottom", fontsize=7,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(arms)), [ARM_LABELS.get(a, a) for a in arms])
    ax.set(xlabel="", ylabel="learner tokens / s",
           title=f"Learner throughput: {table['model'].iloc[0]}, {table['layers'].iloc[0]} layers")
    ax.margins(y=0.2)
    return save(fig, out_stem, footer or footer_from(table.to_dict("records")))


def _log_positive(ax, df: pd.DataFrame, y: str, hue_colors: dict, ylabel: str, smooth: int) -> None:
    """Per-arm curve of ``y`` vs step on a log axis. Exact zeros (identical engines) cannot sit on a log
    axis: they are drawn at a floor one decade under the smallest positive value, and the legend says so."""
    pos = df.loc[df[y] > 0, y]
    floor = (pos.min() / 10) if len(pos) else 1e-12
    for arm, g in df.groupby("arm", sort=False):
        g = g.sort_values("step")
        vals = g[y].astype(float)
        label = ARM_LABELS.get(arm, arm)
        if (vals == 0).all():
            label += f" (= 0, drawn at {floor:.0e})"
        vals = vals.clip(lower=floor)
        ax.plot(g["step"], vals, color=hue_colors[arm], alpha=0.3 if smooth > 1 else 1.0, lw=0.8)
        if smooth > 1:
            ax.plot(g["step"], vals.rolling(smooth, min_periods=1).mean(), color=hue_colors[arm], lw=1.6,
                    label=label)
        else:
            ax.lines[-1].set_label(label)
    ax.set_yscale("log")
    ax.set(xlabel="RL step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def drift(stability: pd.DataFrame, out_stem=None, summaries: dict | None = None, smooth: int = 5,
          footer: str | None = None):
    """Trainer/sampler drift per RL step: k3 (KL estimate) and max |p_train - p_sample|, log scale. A
    vertical dotted line marks each arm's drift alarm step when its stability summary records one."""
    if stability.empty:
        raise ResultError("no stability records to plot")
    sns.set_theme(style="whitegrid", context="paper")
    colors = palette(stability["arm"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharex=True)
    for ax, (name, ylabel) in zip(axes, [("k3", "k3 KL(sampler || trainer)"),
                                         ("max_abs_dp", "max |p_train - p_sample|")]):
        df = stability[["arm", "step", column(stability, name)]]
        df.columns = ["arm", "step", name]
        _log_positive(ax, df, name, colors, ylabel, smooth)
        for arm, s in (summaries or {}).items():
            step = _alarm_step(s)
            if step is not None and arm in colors:
                ax.axvline(step, color=colors[arm], ls=":", lw=1)
    axes[0].legend(fontsize=7)
    fig.suptitle("Trainer/sampler mismatch during RL" + (f" (rolling mean of {smooth})" if smooth > 1 else ""))
    return save(fig, out_stem, footer)


def _alarm_step(summary: dict):
    for key in ("alarm_step", "drift_alarm_step"):
        if isinstance(summary.get(key), (int, float)):
            return summary[key]
    alarm = summary.get("drift_alarm") or summary.get("alarm")
    if isinstance(alarm, dict) and isinstance(alarm.get("step"), (int, float)):
        return alarm["step"]
    return None


def reward_eval(stability: pd.DataFrame, evals: pd.DataFrame | None = None, out_stem=None, smooth: int = 5,
                eval_metric: str | None = None, footer: str | None = None):
    """Training reward per RL step (rolling mean) and held-out eval accuracy per checkpoint, per arm."""
    if stability.empty:
        raise ResultError("no stability records to plot")
    sns.set_theme(style="whitegrid", context="paper")
    colors = palette(stability["arm"].unique())
    have_evals = evals is not None and not evals.empty
    fig, axes = plt.subplots(1, 2 if have_evals else 1, figsize=(9 if have_evals else 4.8, 3.4), squeeze=False)
    ax = axes[0, 0]
    rcol = column(stability, ("reward_mean", "reward"))
    for arm, g in stability.groupby("arm", sort=False):
        g = g.sort_values("step")
        ax.plot(g["step"], g[rcol], color=colors[arm], alpha=0.25, lw=0.8)
        ax.plot(g["step"], g[rcol].rolling(smooth, min_periods=1).mean(), color=colors[arm], lw=1.6,
                label=ARM_LABELS.get(arm, arm))
    ax.set(xlabel="RL step", ylabel="mean reward", title="Training reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    if have_evals:
        ax = axes[0, 1]
        metric = eval_metric or _eval_metric(evals)
        step = column(evals, "step")
        sns.lineplot(data=evals.sort_values(step), x=step, y=metric, hue="arm", palette=colors, marker="o",
                     ax=ax, legend=False)
        ks = evals["k"].dropna().unique() if "k" in evals else []
        label = f"mean@{int(ks[0])} accuracy" if metric == "mean_at_k" and len(ks) == 1 else metric
        ax.set(xlabel="checkpoint step", ylabel=label, title="Held-out accuracy (sampler engine)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return save(fig, out_stem, footer)


def _eval_metric(evals: pd.DataFrame) -> str:
    """The accuracy column of evals.csv: the first 'mean@k' / 'mean_at_k' column, else 'accuracy'."""
    for c in evals.columns:
        if str(c).startswith(("mean@", "mean_at_")):
            return c
    return column(evals, "accuracy")


def kernel_throughput(kernels: pd.DataFrame, out_stem=None, y: str = "tflops", footer: str | None = None):
    """Dense-GEMM kernel throughput vs M (tokens), one panel per weight shape, one line per provider
    (kernels.csv of kernel-bench: kernel, provider, shape, M, N, K, median_ms, tflops, ...), log2 x."""
    need = {"M", y, "provider", "shape"}
    if not need <= set(kernels.columns):
        raise ResultError(f"kernels.csv needs columns {sorted(need)}; has {list(kernels.columns)}")
    d = kernels[kernels["kernel"] == "gemm"] if "kernel" in kernels else kernels
    d = d[d[y].notna()]
    if d.empty:
        raise ResultError("kernels.csv has no finite dense-GEMM timings")
    sns.set_theme(style="whitegrid", context="paper")
    shapes = list(dict.fromkeys(d["shape"]))
    labels = {s: (f"{s} (N={int(g.N.iloc[0])}, K={int(g.K.iloc[0])})" if {"N", "K"} <= set(g) else s)
              for s, g in d.groupby("shape", sort=False)}
    g = sns.relplot(data=d.assign(shape=d["shape"].map(labels)), x="M", y=y, hue="provider", col="shape",
                    col_order=[labels[s] for s in shapes], col_wrap=min(4, len(shapes)), kind="line",
                    marker="o", height=2.6, aspect=1.1, facet_kws={"sharey": False})
    g.set(xscale="log")
    for ax in g.axes.flat:
        ax.set_xscale("log", base=2)
    g.set_titles("{col_name}", size=8)
    g.set_axis_labels("M (tokens)", "TFLOP/s" if y == "tflops" else y)
    g.figure.suptitle("NVFP4 GEMM throughput vs M", y=1.02)
    return save(g.figure, out_stem, footer or footer_from(d.to_dict("records")[:1]))


#: the panels of the drift-study figure: (column, y label, log scale)
STUDY_PANELS = (("k3", "k3 KL(sampler || trainer)", True), ("max_abs_dp", "max |p_train - p_sample|", True),
                ("grad_norm", "gradient norm (before clipping)", True),
                ("router_disagree", "router top-k sets that differ", True),
                ("reward_mean", "training reward", False), ("heldout", "held-out accuracy (mean@k)", False))


def _band(ax, d: pd.DataFrame, x: str, y: str, color, label: str, smooth: int, floor: float | None) -> None:
    """One arm: the mean over its seeds of the (rolling-mean) curve, and the min-max band over seeds."""
    wide = d.pivot_table(index=x, columns="seed", values=y).sort_index()
    if floor is not None:
        wide = wide.clip(lower=floor)
    if smooth > 1:
        wide = wide.rolling(smooth, min_periods=1).mean()
    ax.plot(wide.index, wide.mean(axis=1), color=color, lw=1.5, label=label, marker="o" if x == "updates" else None,
            ms=3)
    if wide.shape[1] > 1:
        ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=color, alpha=0.2, lw=0)


def drift_study(stability: pd.DataFrame, heldout: pd.DataFrame | None = None, out_stem=None, smooth: int = 10,
                summaries: dict | None = None, footer: str | None = None):
    """The drift study's six panels vs RL step, every arm, seeds pooled (line = mean over seeds, band = their
    range): k3, max |dp|, gradient norm and router disagreement (log scale; an exact 0 is drawn at a floor a
    decade under the smallest positive value, and the legend says so), training reward, and held-out accuracy vs
    updates (``load.load_heldout``). ``stability``: ``load.load_stability`` of run directories (``<arm>`` or
    ``<arm>_seed<N>``). A dotted line marks each run's drift alarm (its stability summary's alarm_step)."""
    from minite.report.load import parse_run

    if stability.empty:
        raise ResultError("no stability records to plot")
    runs = stability["arm"].astype(str)
    stab = stability.assign(run=runs, arm=[parse_run(r)[0] for r in runs], seed=[parse_run(r)[1] for r in runs])
    arms = list(dict.fromkeys(stab["arm"]))
    colors = palette(arms)
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.4), sharex=False)
    for ax, (name, ylabel, log) in zip(axes.flat, STUDY_PANELS):
        if name == "heldout":
            have = heldout is not None and not heldout.empty
            for arm in arms if have else []:
                d = heldout[heldout["arm"] == arm]
                if len(d):
                    _band(ax, d, "updates", "mean_at_k", colors[arm], ARM_LABELS.get(arm, arm), 1, None)
            ax.set(xlabel="updates", ylabel=ylabel, title=None if have else "no held-out evaluations")
            continue
        col = column(stab, name, required=False)
        if col is None:
            ax.set(xlabel="RL step", ylabel=ylabel, title=f"not logged ({name})")
            continue
        d = stab[["arm", "seed", "step", col]].rename(columns={col: name}).dropna()
        pos = d.loc[d[name] > 0, name]
        floor = (pos.min() / 10 if len(pos) else 1e-12) if log else None
        for arm in arms:
            da = d[d["arm"] == arm]
            if da.empty:
                continue
            label = ARM_LABELS.get(arm, arm)
            if log and (da[name] == 0).all():
                label += f" (= 0, drawn at {floor:.0e})"
            _band(ax, da, "step", name, colors[arm], label, smooth, floor)
        if log:
            ax.set_yscale("log")
        ax.set(xlabel="RL step", ylabel=ylabel)
        for run, summ in (summaries or {}).items():
            arm = parse_run(run)[0]
            if name == "k3" and arm in colors and isinstance(summ.get("alarm_step"), (int, float)):
                ax.axvline(summ["alarm_step"], color=colors[arm], ls=":", lw=1)
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.flat[0].legend(fontsize=7)
    seeds = stab.groupby("arm")["seed"].nunique()
    note = ", ".join(f"{ARM_LABELS.get(a, a)}: {n} seeds" for a, n in seeds.items() if n > 1)
    fig.suptitle("Drift study: mismatch, gradients, routing, reward and held-out accuracy"
                 + (f" (rolling mean of {smooth})" if smooth > 1 else "") + (f"; bands over seeds ({note})" if note
                                                                             else ""))
    fig.tight_layout()
    return save(fig, out_stem, footer or footer_from([s.get("provenance") or {} for s in (summaries or {}).values()]))
