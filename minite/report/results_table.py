"""The accuracy / stability table of the RL runs (csv / md / tex): one row per arm, its seeds pooled.

Read from each run directory (``<arm>`` or ``<arm>_seed<N>``, ``minite.report.load.run_name``):
``stability.jsonl`` (always), ``stability_summary.json`` when the run finished (alarm and collapse steps; an
unfinished run's come from the per-step flags of its step log, so a run cut short still has a row), and the
held-out accuracy (``load.load_heldout``: the in-run evaluation, else the eval job's evals.csv).

Columns (``COLUMNS``); a value over seeds is their mean and ``*_spread`` the max - min over seeds (0 for one
seed):
    arm, seeds            the arm and its run seeds ("0;1")
    steps                 GRPO steps in the step log (the smallest over seeds)
    heldout_start         held-out accuracy of the warm start (0 updates; mean@k of the sampler engine)
    heldout_best          the best held-out accuracy over the run
    heldout_end           the last one measured
    k3_median, k3_max     median / max over the run's steps of k3 (KL(sampler || trainer), token mean); median
                          is a mean over seeds, max the max over seeds
    collapse_step         the step the reward collapsed (minite.rl.drift.CollapseDetector) per seed, or "none"
    alarm_step            the step the drift alarm (CUSUM on the run's drift metric, k3) fired per seed, or "none"
    first_watch_alarm     the earliest alarm on a watched metric (``metrics.watch``) per seed, "metric@step", or
                          "none"
    step_s                median wall time of one RL step (s), mean over seeds
    device, sha           where and from which commit (every run's, ";"-joined when they differ)
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from minite.provenance import write_csv, write_text
from minite.report import load
from minite.report.load import ResultError, column, load_heldout, load_stability, load_stability_summary, parse_run

COLUMNS = ["arm", "seeds", "steps", "heldout_start", "heldout_start_spread", "heldout_best", "heldout_best_spread",
           "heldout_end", "heldout_end_spread", "k3_median", "k3_max", "collapse_step", "alarm_step",
           "first_watch_alarm", "step_s", "device", "sha"]


def _first_flag(stab: pd.DataFrame, flag: str) -> int | None:
    """The first step whose ``flag`` column is true (the per-step alarm / collapse flags of the step log)."""
    if flag not in stab:
        return None
    hit = stab.loc[stab[flag].eq(True), "step"]
    return int(hit.min()) if len(hit) else None


def _run_record(results_dir: Path, run: str, stab: pd.DataFrame, held: pd.DataFrame) -> dict:
    """One run's numbers (its step log, summary if finished, held-out curve)."""
    done = (Path(results_dir) / run / "stability_summary.json").exists()
    summary = load_stability_summary(results_dir, [run])[run] if done else {}
    prov = summary.get("provenance")
    if prov is None:
        meta = Path(results_dir) / run / "run.json"
        prov = load.read_json(meta).get("provenance", {}) if meta.exists() else {}
    if summary:
        alarm, collapse = summary.get("alarm_step"), summary.get("collapse_step")
        watch = {m: s for m, s in (summary.get("alarms") or {}).items() if m != summary.get("drift_metric")}
    else:
        alarm, collapse = _first_flag(stab, "alarm"), _first_flag(stab, "collapsed")
        flags = [c for c in stab.columns if c.startswith("watch/") and c.endswith("/alarm")]
        watch = {c.split("/")[1]: _first_flag(stab, c) for c in flags}
    fired = sorted((s, m) for m, s in watch.items() if s is not None)
    k3 = stab[column(stab, "k3")].astype(float)
    h = held.sort_values("updates")["mean_at_k"].astype(float)
    return {"steps": int(stab["step"].max()), "k3_median": float(k3.median()), "k3_max": float(k3.max()),
            "alarm": alarm, "collapse": collapse, "watch": f"{fired[0][1]}@{fired[0][0]}" if fired else None,
            "step_s": float(stab["step_s"].median()) if "step_s" in stab else math.nan,
            "start": float(h.iloc[0]) if len(h) and int(held["updates"].min()) == 0 else math.nan,
            "best": float(h.max()) if len(h) else math.nan, "end": float(h.iloc[-1]) if len(h) else math.nan,
            "device": prov.get("device", "?"), "sha": prov.get("sha", "?"), "date": prov.get("date", "?"),
            "command": prov.get("command", "?")}


def _mean_spread(values: list[float]) -> tuple[float, float]:
    v = [x for x in values if not math.isnan(x)]
    return (sum(v) / len(v), max(v) - min(v)) if v else (math.nan, math.nan)


def _per_seed(values) -> str:
    return ";".join("none" if v is None else str(v) for v in values)


def results_table(results_dir, runs) -> tuple[pd.DataFrame, dict[str, dict]]:
    """(the table, run -> its record for the provenance list). ``runs``: run directory names, in display order."""
    results_dir = Path(results_dir)
    records: dict[str, dict] = {}
    for run in runs:
        stab = load_stability(results_dir, [run])
        if stab.empty:
            raise ResultError(f"{results_dir / run / 'stability.jsonl'} has no steps")
        records[run] = _run_record(results_dir, run, stab, load_heldout(results_dir, [run]))
    by_arm: dict[str, list[tuple[int, dict]]] = {}
    for run, rec in records.items():
        arm, seed = parse_run(run)
        by_arm.setdefault(arm, []).append((seed, rec))
    rows = []
    for arm, seeded in by_arm.items():
        seeded.sort(key=lambda x: x[0])
        recs = [r for _, r in seeded]
        row = {"arm": arm, "seeds": ";".join(str(s) for s, _ in seeded), "steps": min(r["steps"] for r in recs)}
        for key in ("start", "best", "end"):
            row[f"heldout_{key}"], row[f"heldout_{key}_spread"] = _mean_spread([r[key] for r in recs])
        row.update(k3_median=sum(r["k3_median"] for r in recs) / len(recs), k3_max=max(r["k3_max"] for r in recs),
                   collapse_step=_per_seed(r["collapse"] for r in recs), alarm_step=_per_seed(r["alarm"] for r in recs),
                   first_watch_alarm=_per_seed(r["watch"] for r in recs),
                   step_s=sum(r["step_s"] for r in recs) / len(recs),
                   device=";".join(dict.fromkeys(r["device"] for r in recs)),
                   sha=";".join(dict.fromkeys(str(r["sha"]) for r in recs)))
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS), records


def _acc(mean, spread) -> str:
    if mean is None or math.isnan(mean):
        return "n/a"
    return f"{mean:.3f}" + (f" ± {spread / 2:.3f}" if spread and not math.isnan(spread) else "")


def to_markdown(df: pd.DataFrame, records: dict[str, dict], profile: str) -> str:
    header = ["arm", "seeds", "steps", "held-out start", "best", "end", "k3 median", "k3 max", "collapse",
              "alarm (k3)", "first other alarm", "step (s)"]
    body = [[r.arm, r.seeds, r.steps, _acc(r.heldout_start, r.heldout_start_spread),
             _acc(r.heldout_best, r.heldout_best_spread), _acc(r.heldout_end, r.heldout_end_spread),
             f"{r.k3_median:.3g}", f"{r.k3_max:.3g}", r.collapse_step, r.alarm_step, r.first_watch_alarm,
             "n/a" if math.isnan(r.step_s) else f"{r.step_s:.2f}"] for r in df.itertuples()]
    lines = [f"# Accuracy and stability of the RL runs ({profile} profile)", "",
             "One row per arm, its seeds pooled: held-out accuracy (mean@k of the sampler engine) at the warm "
             "start, best and last, as mean ± half the seed range; k3 = KL(sampler || trainer) over the run's "
             "steps; the step of the reward collapse, of the drift alarm on k3 and of the first alarm on another "
             "watched metric, per seed (\"none\": it did not happen); the median RL step time. Definitions: "
             "minite.report.results_table.", "", _table(header, body), "", "## Provenance", "",
             _table(["run", "sha", "device", "date", "command"],
                    [[run, r["sha"], r["device"], r["date"], f"`{r['command']}`"] for run, r in records.items()]), ""]
    return "\n".join(lines)


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def to_latex(df: pd.DataFrame) -> str:
    t = pd.DataFrame({
        "Arm": df["arm"], "Seeds": df["seeds"], "Steps": df["steps"],
        "Acc. start": [_acc(m, s) for m, s in zip(df.heldout_start, df.heldout_start_spread, strict=True)],
        "Acc. best": [_acc(m, s) for m, s in zip(df.heldout_best, df.heldout_best_spread, strict=True)],
        "Acc. end": [_acc(m, s) for m, s in zip(df.heldout_end, df.heldout_end_spread, strict=True)],
        "k3 median": df["k3_median"], "k3 max": df["k3_max"], "Collapse": df["collapse_step"],
        "Alarm": df["alarm_step"], "Step (s)": df["step_s"]})
    sty = (t.style.hide(axis="index").format({"k3 median": "{:.2e}", "k3 max": "{:.2e}", "Step (s)": "{:.2f}"},
                                             na_rep="--")
           .format(escape="latex", subset=["Arm", "Seeds", "Acc. start", "Acc. best", "Acc. end", "Collapse",
                                           "Alarm"]))
    return sty.to_latex(hrules=True, column_format="ll" + "r" * (t.shape[1] - 2))


def write_results_table(results_dir, runs, out_prefix=None, profile: str | None = None) -> pd.DataFrame:
    """Write ``<out_prefix>.{csv,md,tex}`` (default ``<results_dir>/results_table``); returns the table."""
    results_dir = Path(results_dir)
    out_prefix = Path(out_prefix) if out_prefix else results_dir / "results_table"
    df, records = results_table(results_dir, runs)
    write_csv(out_prefix.with_suffix(".csv"), df)
    write_text(out_prefix.with_suffix(".md"), to_markdown(df, records, profile or results_dir.name))
    write_text(out_prefix.with_suffix(".tex"), to_latex(df))
    return df
