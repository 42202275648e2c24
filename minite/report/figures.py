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
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

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
    """Learner tokens/s per arm (the throughput table): bars at the median, error bars over the per-step
    interquartile range, each bar labelled with its ratio to BF16; a row the table flags is marked. When the
    table has rollout columns (``bench-sampler``), a second panel: decode tokens/s per arm, each bar labelled
    with its ratio to BF16 and the fraction of its bandwidth roofline it reached."""
    sns.set_theme(style="whitegrid", context="paper")
    arms = list(table["arm"])
    rollout = table["rollout_tokens_per_s"].notna().any() if "rollout_tokens_per_s" in table else False
    fig, axes = plt.subplots(1, 2 if rollout else 1, figsize=(10 if rollout else 5, 3.4), squeeze=False)
    ax = axes[0][0]
    sns.barplot(data=table, x="arm", y="tokens_per_s", hue="arm", palette=palette(arms), legend=False,
                ax=ax, order=arms)
    if {"tokens_per_s_q25", "tokens_per_s_q75"} <= set(table.columns):
        ax.errorbar(range(len(arms)), table["tokens_per_s"],
                    yerr=[table["tokens_per_s"] - table["tokens_per_s_q25"],
                          table["tokens_per_s_q75"] - table["tokens_per_s"]],
                    fmt="none", ecolor="0.2", elinewidth=1, capsize=4)
    for i, r in enumerate(table.itertuples()):
        label = f"{r.tokens_per_s:,.0f}"
        if not (isinstance(r.ratio_vs_bf16, float) and math.isnan(r.ratio_vs_bf16)):
            label += f"\n{r.ratio_vs_bf16:.2f}x BF16"
        if getattr(r, "flag", ""):
            label += "\n⚠ " + r.flag
        top = getattr(r, "tokens_per_s_q75", r.tokens_per_s)
        ax.annotate(label, (i, top), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(range(len(arms)), [ARM_LABELS.get(a, a) for a in arms])
    ax.set(xlabel="", ylabel="learner tokens / s (median; bars: interquartile range)",
           title=f"Learner throughput: {table['model'].iloc[0]}, {table['layers'].iloc[0]} layers")
    ax.margins(y=0.3)
    if rollout:
        _rollout_bars(axes[0][1], table.dropna(subset=["rollout_tokens_per_s"]))
    fig.tight_layout()
    return save(fig, out_stem, footer or footer_from(table.to_dict("records")))


def _rollout_bars(ax, table: pd.DataFrame) -> None:
    arms = list(table["arm"])
    sns.barplot(data=table, x="arm", y="rollout_tokens_per_s", hue="arm", palette=palette(arms), legend=False,
                ax=ax, order=arms)
    for i, r in enumerate(table.itertuples()):
        label = f"{r.rollout_tokens_per_s:,.0f}"
        if not math.isnan(r.rollout_ratio_vs_bf16):
            label += f"\n{r.rollout_ratio_vs_bf16:.2f}x BF16"
        label += f"\n{100 * r.rollout_roofline_frac:.0f}% of roofline"
        ax.annotate(label, (i, r.rollout_tokens_per_s), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(range(len(arms)), [ARM_LABELS.get(a, a) for a in arms])
    ax.set(xlabel="", ylabel="decode tokens / s (labels: ratio of median steps)",
           title="Rollout (decode) throughput")
    ax.margins(y=0.35)


def step_split(learner: dict[str, dict], out_stem=None, footer: str | None = None):
    """Where a learner step goes, per arm: the medians of bench-learner's ``step_split_ms`` as stacked bars
    (the legend sits beside the bars, never over them). None when no record has a split."""
    splits = {a: r["step_split_ms"] for a, r in learner.items() if isinstance(r.get("step_split_ms"), dict)
              and any(v is not None for v in r["step_split_ms"].values())}   # --split-steps 0: no split
    if not splits:
        return None
    df = pd.DataFrame(splits).T.fillna(0.0)
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.5, 0.5 * len(df) + 1.4))
    df.index = [ARM_LABELS.get(a, a) for a in df.index]
    df.plot.barh(stacked=True, ax=ax, colormap="tab20c", width=0.7)
    ax.invert_yaxis()
    ax.set(xlabel="ms per learner step (medians over the split updates)", ylabel="")
    ax.legend(title="phase", fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(fig, out_stem, footer)


def _log_positive(ax, df: pd.DataFrame, y: str, hue_colors: dict, ylabel: str, smooth: int) -> None:
    """Per-arm curve of ``y`` vs step on a log axis. Exact zeros (identical engines) cannot sit on a log
    axis: they are drawn at a floor one decade under the smallest positive value, which the panel marks with
    a dashed line labelled "exact 0" (the same words in every panel)."""
    pos = df.loc[df[y] > 0, y]
    floor = (pos.min() / 10) if len(pos) else 1e-12
    for arm, g in df.groupby("arm", sort=False):
        g = g.sort_values("step")
        vals = g[y].astype(float)
        label = ARM_LABELS.get(arm, arm) + (" (exact 0 at every step)" if (vals == 0).all() else "")
        vals = vals.clip(lower=floor)
        ax.plot(g["step"], vals, color=hue_colors[arm], alpha=0.3 if smooth > 1 else 1.0, lw=0.8)
        if smooth > 1:
            ax.plot(g["step"], vals.rolling(smooth, min_periods=1).mean(), color=hue_colors[arm], lw=1.6,
                    label=label)
        else:
            ax.lines[-1].set_label(label)
    ax.set_yscale("log")
    if (df[y] == 0).any():
        ax.axhline(floor, color="0.5", ls="--", lw=0.7, zorder=0)
        ax.annotate(f"exact 0 (drawn at {floor:.0e})", (0.01, floor), xycoords=("axes fraction", "data"),
                    xytext=(0, 3), textcoords="offset points", fontsize=7, color="0.35", va="bottom")
        ax.set_ylim(bottom=floor / 3)
    ax.set(xlabel="RL step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_below(fig, axes, ncol: int) -> None:
    """One legend for all panels, centred under them: it can never cover a curve. The first panel's
    handles name the arms (each arm has one colour in every panel)."""
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8,
               frameon=False)


def drift(stability: pd.DataFrame, out_stem=None, summaries: dict | None = None, smooth: int = 5,
          footer: str | None = None):
    """Trainer/sampler drift per RL step: k3 (KL estimate) and max |p_train - p_sample|, log scale. A
    vertical dotted line marks each arm's drift alarm step when its stability summary records one."""
    if stability.empty:
        raise ResultError("no stability records to plot")
    sns.set_theme(style="whitegrid", context="paper")
    colors = palette(stability["arm"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharex=True, layout="constrained")
    for ax, (name, ylabel) in zip(axes, [("k3", "k3 KL(sampler || trainer)"),
                                         ("max_abs_dp", "max |p_train - p_sample|")], strict=True):
        df = stability[["arm", "step", column(stability, name)]]
        df.columns = ["arm", "step", name]
        _log_positive(ax, df, name, colors, ylabel, smooth)
        for arm, s in (summaries or {}).items():
            step = _alarm_step(s)
            if step is not None and arm in colors:
                ax.axvline(step, color=colors[arm], ls=":", lw=1, label=f"{ARM_LABELS.get(arm, arm)} drift alarm")
    _legend_below(fig, axes, ncol=len(colors))
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
    """Training reward per RL step (rolling mean) and held-out eval accuracy per checkpoint, per arm, both on
    the full 0..1 scale (a narrow automatic range would magnify sampling noise). Eval points carry +-1
    standard error bars (``eval_error``)."""
    if stability.empty:
        raise ResultError("no stability records to plot")
    sns.set_theme(style="whitegrid", context="paper")
    colors = palette(stability["arm"].unique())
    have_evals = evals is not None and not evals.empty
    fig, axes = plt.subplots(1, 2 if have_evals else 1, figsize=(9 if have_evals else 4.8, 3.6), squeeze=False,
                             layout="constrained")
    ax = axes[0, 0]
    rcol = column(stability, ("reward_mean", "reward"))
    for arm, g in stability.groupby("arm", sort=False):
        g = g.sort_values("step")
        ax.plot(g["step"], g[rcol], color=colors[arm], alpha=0.25, lw=0.8)
        ax.plot(g["step"], g[rcol].rolling(smooth, min_periods=1).mean(), color=colors[arm], lw=1.6,
                label=ARM_LABELS.get(arm, arm))
    ax.set(xlabel="RL step", ylabel="mean reward", title="Training reward" + (
        f" (thin: per step; thick: rolling mean of {smooth})" if smooth > 1 else ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _unit_range(ax, stability[rcol])
    if have_evals:
        ax = axes[0, 1]
        metric = eval_metric or _eval_metric(evals)
        step = column(evals, "step")
        err, err_label = eval_error(evals, metric)
        groups = list(evals.assign(_err=err).sort_values(step).groupby("arm", sort=False))
        dodge = 0.012 * max(float(evals[step].max() - evals[step].min()), 1.0)  # error bars side by side
        for i, (arm, g) in enumerate(groups):
            ax.errorbar(g[step] + (i - (len(groups) - 1) / 2) * dodge, g[metric], yerr=g["_err"],
                        color=colors.get(arm), marker="o", ms=4, lw=1.4, capsize=3, label=ARM_LABELS.get(arm, arm))
        ks = evals["k"].dropna().unique() if "k" in evals else []
        label = f"mean@{int(ks[0])} accuracy" if metric == "mean_at_k" and len(ks) == 1 else metric
        ax.set(xlabel="checkpoint step", ylabel=label, title="Held-out accuracy (sampler engine)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _unit_range(ax, evals[metric] + err)
        ax.annotate(f"error bars: {err_label}", (0.99, 0.98), xycoords="axes fraction", ha="right", va="top",
                    fontsize=7, color="0.35")
    _legend_below(fig, axes[0], ncol=len(colors))        # names the arms of both panels, covers neither
    return save(fig, out_stem, footer)


def _unit_range(ax, values: pd.Series) -> None:
    """Rewards and accuracies lie in [0, 1]: show all of it (more only if the data go beyond)."""
    top = float(values.max()) if len(values) else 1.0
    ax.set_ylim(min(0.0, float(values.min())) if len(values) else 0.0, 1.0 if top <= 1.0 else top * 1.05)


def eval_error(evals: pd.DataFrame, metric: str) -> tuple[pd.Series, str]:
    """+-1 standard error of each eval point, and what it is. evals.csv holds the mean over prompts, not the
    per-prompt scores, so the error uses the bound sqrt(p (1 - p) / n_prompts): each prompt's score lies in
    [0, 1], so its variance is at most p (1 - p). A ``<metric>_se`` column, when the file has one, wins."""
    if f"{metric}_se" in evals:
        return evals[f"{metric}_se"].astype(float), "+-1 standard error"
    if "n_prompts" not in evals:
        return pd.Series(0.0, index=evals.index), "none (no n_prompts)"
    p = evals[metric].astype(float).clip(0, 1)
    return (p * (1 - p) / evals["n_prompts"].astype(float)).pow(0.5), "+-1 s.e. bound, sqrt(p(1-p)/n_prompts)"


def _eval_metric(evals: pd.DataFrame) -> str:
    """The accuracy column of evals.csv: the first 'mean@k' / 'mean_at_k' column, else 'accuracy'."""
    for c in evals.columns:
        if str(c).startswith(("mean@", "mean_at_")):
            return c
    return column(evals, "accuracy")


def kernel_throughput(kernels: pd.DataFrame, out_stem=None, y: str = "tflops", footer: str | None = None):
    """Dense-GEMM kernel throughput vs M (tokens), one panel per weight shape, one line per provider
    (kernels.csv of kernel-bench: kernel, provider, shape, M, N, K, median_ms, tflops, ...), log2 x and log y
    (on a linear y the decode regime, M <= 128, would be invisible beside M = 16384)."""
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
    for ax in g.axes.flat:             # log-log: M <= 128 (decode) sits decades below M = 16384
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    g.set_titles("{col_name}", size=8)
    g.set_axis_labels("M (tokens)", ("TFLOP/s" if y == "tflops" else y) + " (log)")
    g.figure.suptitle("NVFP4 GEMM throughput vs M (log-log)", y=1.02)
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
    for ax, (name, ylabel, log) in zip(axes.flat, STUDY_PANELS, strict=True):
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
