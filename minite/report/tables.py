"""The learner throughput table (csv / md / tex), with the paper's numbers beside ours.

One row per arm, columns exactly ``COLUMNS``. Ratios are against the ``bf16`` and ``naive_te_nvfp4`` rows
of the same table, and are left empty (NaN) when that reference arm is not among the arms requested.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from minite.provenance import write_csv, write_text
from minite.report.load import ResultError, load_learner

COLUMNS = ["arm", "tokens_per_s", "ratio_vs_bf16", "ratio_vs_naive", "step_ms", "peak_mem_gb", "device",
           "model", "layers", "sha"]
BF16, NAIVE, MINITE = "bf16", "naive_te_nvfp4", "minite_nvfp4"

#: The miniTE paper's learner throughput (Qwen3-30B-A3B, one B300 node). Quoted, never measured here.
PAPER = {"model": "Qwen3-30B-A3B (full model)", "device": "one B300 node",
         "arm": MINITE, "tokens_per_s": 33540.0, "ratio_vs_bf16": 1.39, "ratio_vs_naive": 1.47}


def throughput_table(learner: dict[str, dict]) -> pd.DataFrame:
    """learner: arm -> learner.json record (``load_learner``), in the row order wanted."""
    if not learner:
        raise ResultError("no learner results to tabulate")
    setups = {(str(r["model"]), str(r["layers"])) for r in learner.values()}
    if len(setups) > 1:
        raise ResultError(f"learner results are for different model slices {sorted(setups)}: ratios would "
                          "be meaningless; rerun bench-learner for every arm with one config")
    rows = [{"arm": arm, **{c: rec.get(c) for c in COLUMNS if c != "arm"}} for arm, rec in learner.items()]
    df = pd.DataFrame(rows)
    tps = dict(zip(df["arm"], df["tokens_per_s"]))
    df["ratio_vs_bf16"] = df["tokens_per_s"] / tps[BF16] if BF16 in tps else math.nan
    df["ratio_vs_naive"] = df["tokens_per_s"] / tps[NAIVE] if NAIVE in tps else math.nan
    df["tokens_per_s"] = df["tokens_per_s"].astype(float)
    return df[COLUMNS]


def _fmt(v, spec: str, na: str = "n/a") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return na
    return format(v, spec)


def _ratio(v) -> str:
    return _fmt(v, ".2f") + ("" if v is None or (isinstance(v, float) and math.isnan(v)) else "x")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table (written by hand: no dependency on tabulate)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def to_markdown(df: pd.DataFrame, learner: dict[str, dict], profile: str) -> str:
    devices = sorted(set(df["device"].astype(str)))
    model, layers = df["model"].iloc[0], df["layers"].iloc[0]
    out = [f"# Learner throughput ({profile} profile)", "",
           f"Complete learner updates (forward, backward, optimizer step) of `{model}` "
           f"({layers} layers) on {', '.join(devices)}; measured by `python -m minite bench-learner`.", ""]
    if len(devices) > 1:
        out += ["**Warning: the arms were measured on different devices; the ratios compare devices as "
                "well as arms.**", ""]
    out.append(_md_table(
        ["arm", "tokens/s", "vs BF16", "vs naive TE NVFP4", "step (ms)", "peak mem (GB)"],
        [[r.arm, _fmt(r.tokens_per_s, ",.0f"), _ratio(r.ratio_vs_bf16),
          _ratio(r.ratio_vs_naive), _fmt(r.step_ms, ",.1f"), _fmt(r.peak_mem_gb, ".2f")]
         for r in df.itertuples()]))
    ours = df.set_index("arm")
    m = ours.loc[MINITE] if MINITE in ours.index else None
    out += ["", f"## Paper vs this run ({MINITE})", "",
            _md_table(["", f"paper ({PAPER['model']}, {PAPER['device']})", f"this run ({model}, {layers} "
                       f"layers, {', '.join(devices)})"],
                      [["tokens/s", f"{PAPER['tokens_per_s']:,.0f}",
                        _fmt(None if m is None else m.tokens_per_s, ",.0f")],
                       ["vs BF16", f"{PAPER['ratio_vs_bf16']:.2f}x",
                        _ratio(None if m is None else m.ratio_vs_bf16)],
                       ["vs naive TE NVFP4", f"{PAPER['ratio_vs_naive']:.2f}x",
                        _ratio(None if m is None else m.ratio_vs_naive)]]),
            "", "Absolute tokens/s are only comparable on the same hardware and model; the ratios are the "
            "reproduction target. FP4 speed-ups need FP4 tensor cores (Blackwell): on other devices the "
            "NVFP4 arms run emulated and the ratios measure overheads, not the paper's claim.", "",
            "## Provenance", "",
            _md_table(["arm", "sha", "device", "date", "command"],
                      [[arm, rec.get("sha", "?"), rec.get("device", "?"), rec.get("date", "?"),
                        f"`{rec.get('command', '?')}`"] for arm, rec in learner.items()]), ""]
    return "\n".join(out)


def to_latex(df: pd.DataFrame) -> str:
    t = df[["arm", "tokens_per_s", "ratio_vs_bf16", "ratio_vs_naive", "step_ms", "peak_mem_gb"]].rename(
        columns={"arm": "Arm", "tokens_per_s": "Tokens/s", "ratio_vs_bf16": "vs BF16",
                 "ratio_vs_naive": "vs naive", "step_ms": "Step (ms)", "peak_mem_gb": "Peak mem (GB)"})
    sty = (t.style.hide(axis="index")
           .format({"Tokens/s": "{:,.0f}", "vs BF16": "{:.2f}", "vs naive": "{:.2f}", "Step (ms)": "{:,.1f}",
                    "Peak mem (GB)": "{:.2f}"}, na_rep="--")
           .format(escape="latex", subset=["Arm"]))
    return sty.to_latex(hrules=True, column_format="l" + "r" * (t.shape[1] - 1)) + \
        f"% paper ({PAPER['device']}, {PAPER['model']}): {PAPER['tokens_per_s']:,.0f} tokens/s, " \
        f"{PAPER['ratio_vs_bf16']:.2f}x BF16, {PAPER['ratio_vs_naive']:.2f}x naive TE NVFP4\n"


def write_throughput_table(results_dir, arms, out_prefix=None, profile: str | None = None) -> pd.DataFrame:
    """Read ``<results_dir>/<arm>/learner.json`` for each arm; write ``<out_prefix>.{csv,md,tex}``
    (default ``<results_dir>/throughput_table``). Returns the table."""
    results_dir = Path(results_dir)
    out_prefix = Path(out_prefix) if out_prefix else results_dir / "throughput_table"
    learner = load_learner(results_dir, arms)
    df = throughput_table(learner)
    write_csv(out_prefix.with_suffix(".csv"), df)
    write_text(out_prefix.with_suffix(".md"), to_markdown(df, learner, profile or results_dir.name))
    write_text(out_prefix.with_suffix(".tex"), to_latex(df))
    return df
