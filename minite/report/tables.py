"""The learner throughput table (csv / md / tex), with its spread, the paper's numbers and the reference run.

One row per arm, columns exactly ``COLUMNS``. ``tokens_per_s`` is tokens per update over the median step
time; ``tokens_per_s_q25`` / ``_q75`` the same over the step times' upper / lower quartile, ``n_steps`` the
number of timed steps and ``spread`` their interquartile range over the median (``timing_summary``).

Ratios are against the ``bf16`` and ``naive_te_nvfp4`` rows of the same table (NaN when that arm is not
among the arms requested): the ratio of the medians, with a range from the per-step distributions,
``_lo`` = this arm's q25 tokens/s / the reference arm's q75 and ``_hi`` = q75 / q25. Measured in rounds
(``minite.report.rounds``: every record has the same number of ``rounds``, at least two) a ratio is the
median of the per-round ratios and its range their minimum and maximum; ``n_rounds`` and ``round_spread``
((max - min) / median of an arm's round tokens/s) say how far the rounds agree.

Step split columns (``split_*_ms``, ``split_step_ms``, ``quant_share``; NaN where the record has none): the
medians of bench-learner's ``step_split_ms`` (quantize / gemm / other / optimizer), the median update of the
updates they were measured on (``step_split_step_ms``: bench-learner times the blocks in ``--split-steps``
updates after the timed ones; older records split the timed updates, so their ``step_ms``), and the
quantization's share of that update.

Rollout columns (``rollout_*``, NaN for arms without a ``rollout.json`` of ``bench-sampler``): decode tokens/s,
its ratio to the ``bf16`` arm's (BF16's median decode step over the arm's, same batch) with a range
(``_lo`` = BF16's 10th percentile step over this arm's 90th, ``_hi`` the reverse), the rounds measured, the
fraction of the weights' bandwidth roofline reached, the median decode step (ms). Measured in rounds (every
record with the same number of ``rounds``, at least two) the ratio is the median of the per-round ratios
and its range their minimum and maximum, as for the learner. The rollout setup (model slice, batch) is its
own and is stated in the markdown, with each arm's 10th-90th percentile step.

The trust rule (``flag``): a row is flagged when it has fewer than ``MIN_STEPS`` timed steps (too few to
know its spread), a spread above ``SPREAD_LIMIT`` (10%: a ratio against it can be off by that much) or
rounds that disagree by more than that; a ratio involving a flagged row is marked as not to be trusted.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd

from minite.provenance import write_csv, write_text
from minite.report.load import ResultError, load_learner, load_rollout
from minite.telemetry import SPREAD_LIMIT, timing_summary

COLUMNS = ["arm", "tokens_per_s", "tokens_per_s_q25", "tokens_per_s_q75", "n_steps", "spread", "n_rounds",
           "round_spread", "flag",
           "ratio_vs_bf16", "ratio_vs_bf16_lo", "ratio_vs_bf16_hi",
           "ratio_vs_naive", "ratio_vs_naive_lo", "ratio_vs_naive_hi",
           "step_ms", "peak_mem_gb", "device", "model", "layers", "sha", "torch", "triton", "gpu_driver",
           "rollout_tokens_per_s", "rollout_ratio_vs_bf16", "rollout_ratio_vs_bf16_lo", "rollout_ratio_vs_bf16_hi",
           "rollout_rounds", "rollout_roofline_frac", "rollout_step_ms", "rollout_flag",
           "rollout_sha", "split_quantize_ms", "split_gemm_ms", "split_other_ms", "split_optimizer_ms", "split_step_ms",
           "quant_share"]
SPLIT_KEYS = ("quantize", "gemm", "other", "optimizer")
BF16, NAIVE, MINITE = "bf16", "naive_te_nvfp4", "minite_nvfp4"
#: Fewer timed steps than this and the spread is unknown: the row is flagged.
MIN_STEPS = 5
TRUST_RULE = (f"a row is flagged when it has fewer than {MIN_STEPS} timed steps, its step times' "
              f"interquartile range exceeds {100 * SPREAD_LIMIT:.0f}% of their median, or its rounds' "
              f"tokens/s differ by more than {100 * SPREAD_LIMIT:.0f}% of their median; a ratio involving a "
              "flagged row is marked ⚠ and should not be trusted (rerun on a quiet machine); a rollout row is "
              "flagged the same way by its decode step times")

#: The miniTE paper's learner throughput (Qwen3-30B-A3B, one B300 node). Quoted, never measured here.
PAPER = {"model": "Qwen3-30B-A3B (full model)", "device": "one B300 node",
         "arm": MINITE, "tokens_per_s": 33540.0, "ratio_vs_bf16": 1.39, "ratio_vs_naive": 1.47}


def _flag(n: int, spread: float, round_spread: float) -> str:
    if n < MIN_STEPS:
        return f"only {n} timed steps"
    if not spread <= SPREAD_LIMIT:
        return f"spread {100 * spread:.0f}% > {100 * SPREAD_LIMIT:.0f}%"
    if round_spread > SPREAD_LIMIT:
        return f"rounds differ by {100 * round_spread:.0f}% > {100 * SPREAD_LIMIT:.0f}%"
    return ""


def _round_tps(rec: dict) -> list[float]:
    return [float(r["tokens_per_s"]) for r in rec.get("rounds") or []]


def _row(arm: str, rec: dict) -> dict:
    steps = rec.get("step_ms_all") or [rec["step_ms"]]     # records without per-step times: n = 1
    t = timing_summary(steps)
    tps = float(rec["tokens_per_s"])                        # = tokens / median step time (of the median round)
    rounds = _round_tps(rec)
    round_spread = (max(rounds) - min(rounds)) / statistics.median(rounds) if len(rounds) > 1 else math.nan
    split = {k: v for k, v in (rec.get("step_split_ms") or {}).items() if v is not None}
    split_step = float(rec.get("step_split_step_ms") or rec["step_ms"]) if split else math.nan
    return {"arm": arm, "tokens_per_s": tps, "tokens_per_s_q25": tps * rec["step_ms"] / t["q75"],
            "tokens_per_s_q75": tps * rec["step_ms"] / t["q25"], "n_steps": t["n"], "spread": t["spread"],
            "n_rounds": max(1, len(rounds)), "round_spread": round_spread,
            "flag": _flag(t["n"], t["spread"], round_spread),
            **{c: rec.get(c) for c in ("step_ms", "peak_mem_gb", "device", "model", "layers", "sha", "torch",
                                       "triton", "gpu_driver")},
            **{f"split_{k}_ms": float(split.get(k, math.nan)) for k in SPLIT_KEYS}, "split_step_ms": split_step,
            "quant_share": float(split.get("quantize", math.nan)) / split_step}


def throughput_table(learner: dict[str, dict], rollout: dict[str, dict] | None = None) -> pd.DataFrame:
    """learner: arm -> learner.json record (``load_learner``), in the row order wanted; rollout: arm ->
    rollout.json record (``load_rollout``), for the rollout columns."""
    if not learner:
        raise ResultError("no learner results to tabulate")
    setups = {(str(r["model"]), str(r["layers"])) for r in learner.values()}
    if len(setups) > 1:
        raise ResultError(f"learner results are for different model slices {sorted(setups)}: ratios would "
                          "be meaningless; rerun bench-learner for every arm with one config")
    df = pd.DataFrame([_row(arm, rec) for arm, rec in learner.items()])
    rows = df.set_index("arm")
    counts = {len(_round_tps(rec)) for rec in learner.values()}
    paired = len(counts) == 1 and min(counts) > 1    # every arm measured in the same rounds: pair them
    for ref, name in ((BF16, "ratio_vs_bf16"), (NAIVE, "ratio_vs_naive")):
        if ref not in rows.index:
            df[name] = df[f"{name}_lo"] = df[f"{name}_hi"] = math.nan
            continue
        r = rows.loc[ref]
        df[name] = df["tokens_per_s"] / r.tokens_per_s
        df[f"{name}_lo"] = df["tokens_per_s_q25"] / r.tokens_per_s_q75
        df[f"{name}_hi"] = df["tokens_per_s_q75"] / r.tokens_per_s_q25
        if paired:
            per_round = [[a / b for a, b in zip(_round_tps(learner[arm]), _round_tps(learner[ref]), strict=True)]
                         for arm in df["arm"]]
            df[name] = [statistics.median(x) for x in per_round]
            df[f"{name}_lo"], df[f"{name}_hi"] = [min(x) for x in per_round], [max(x) for x in per_round]
        df.loc[df["arm"] == ref, [name, f"{name}_lo", f"{name}_hi"]] = 1.0    # an arm against itself: exactly 1
    df["tokens_per_s"] = df["tokens_per_s"].astype(float)
    rollout = rollout or {}
    df["rollout_tokens_per_s"] = [float(rollout[a]["decode_tokens_per_s"]) if a in rollout else math.nan
                                  for a in df["arm"]]
    ratios = [_rollout_ratio(rollout, a) for a in df["arm"]]
    for i, name in enumerate(("rollout_ratio_vs_bf16", "rollout_ratio_vs_bf16_lo", "rollout_ratio_vs_bf16_hi")):
        df[name] = [r[i] for r in ratios]
    df["rollout_rounds"] = [max(1, len(_rollout_round_steps(rollout[a]))) if a in rollout else math.nan
                            for a in df["arm"]]
    df["rollout_roofline_frac"] = [float(rollout[a]["roofline_frac"]) if a in rollout else math.nan
                                   for a in df["arm"]]
    df["rollout_step_ms"] = [float(rollout[a]["step_ms"]["median"]) if a in rollout else math.nan
                             for a in df["arm"]]
    df["rollout_flag"] = [_rollout_flag(rollout[a]) if a in rollout else "" for a in df["arm"]]
    # the rollout record's own commit: a reference may keep learner rows of one run beside rollout rows of another
    df["rollout_sha"] = [rollout[a].get("sha") if a in rollout else None for a in df["arm"]]
    return df[COLUMNS]


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _fmt(v, spec: str, na: str = "n/a") -> str:
    return na if _nan(v) else format(v, spec)


def _ratio(v) -> str:
    return _fmt(v, ".2f") + ("" if _nan(v) else "x")


def _ratio_range(df: pd.DataFrame, row, name: str, ref: str) -> str:
    """'1.12x (0.95-1.30)', with ⚠ when this row or the reference row is flagged."""
    v = getattr(row, name)
    if _nan(v):
        return "n/a"
    if row.arm == ref:
        return f"{v:.2f}x"                                  # an arm against itself: exactly 1, nothing to trust
    text = f"{v:.2f}x ({getattr(row, name + '_lo'):.2f}-{getattr(row, name + '_hi'):.2f})"
    flagged = set(df.loc[df["flag"] != "", "arm"])
    return text + (" ⚠" if {row.arm, ref} & flagged else "")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table (written by hand: no dependency on tabulate)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def run_label(learner: dict[str, dict]) -> str:
    """'<sha>, <device>, <day>' of a set of learner records (each distinct value, in order)."""
    def distinct(key, cut=None):
        vals = [str(r.get(key, "?"))[:cut] for r in learner.values()]
        return " / ".join(dict.fromkeys(vals))
    return f"{distinct('sha', 12)}, {distinct('device')}, {distinct('date', 10)}"


def _throughput_rows(df: pd.DataFrame) -> list[list[str]]:
    return [[r.arm, _fmt(r.tokens_per_s, ",.0f"),
             f"{_fmt(r.tokens_per_s_q25, ',.0f')}-{_fmt(r.tokens_per_s_q75, ',.0f')}", str(r.n_steps),
             _fmt(100 * r.spread, ".0f") + "%", _rounds(r), _ratio_range(df, r, "ratio_vs_bf16", BF16),
             _ratio_range(df, r, "ratio_vs_naive", NAIVE), _fmt(r.step_ms, ",.1f"), _fmt(r.peak_mem_gb, ".2f"),
             r.flag or "ok"] for r in df.itertuples()]


def _rounds(r) -> str:
    """'3 (12%)': rounds and how far their tokens/s differ (max - min over the median); '1' for one run."""
    return str(r.n_rounds) + ("" if _nan(r.round_spread) else f" ({100 * r.round_spread:.0f}%)")


THROUGHPUT_HEADER = ["arm", "tokens/s (median)", "interquartile range", "steps", "spread", "rounds", "vs BF16",
                     "vs naive TE NVFP4", "step (ms)", "peak mem (GB)", "trust"]


def _split_section(df: pd.DataFrame) -> list[str]:
    rows = [[r.arm, _fmt(r.split_quantize_ms, ",.1f"), _fmt(r.split_gemm_ms, ",.1f"), _fmt(r.split_other_ms, ",.1f"),
             _fmt(r.split_optimizer_ms, ",.1f"), _fmt(r.split_step_ms, ",.1f"),
             _fmt(100 * r.quant_share, ".1f") + ("" if _nan(r.quant_share) else "%")]
            for r in df.itertuples() if not _nan(r.split_step_ms)]
    if not rows:
        return []
    return ["", "## Where a learner update goes", "",
            "Medians (ms) over the updates bench-learner runs after the timed ones timing every quantize and "
            "NVFP4 GEMM block (`--split-steps`; CUDA events on the GPU, the host clock on CPU; records from "
            "before split the timed updates): "
            "their own median update is the \"update\" column. quantize = the NVFP4 weight / activation / "
            "gradient casts; NVFP4 GEMMs = the arm's W4A4 or emulated GEMMs, forward and backward (n/a for BF16, "
            "whose GEMMs run inside the rest); optimizer = grad-norm clip, AdamW and the master -> BF16 copy; "
            "quantization share = quantize / update.", "",
            _md_table(["arm", "quantize", "NVFP4 GEMMs", "rest of forward / backward", "optimizer", "update",
                       "quantization share"], rows)]


def _rollout_round_steps(rec: dict) -> list[float]:
    """A rollout record's median decode step (ms) in each of its rounds ([] for one run)."""
    return [float(r["step_ms"]["median"]) for r in rec.get("rounds") or []]


def _rollout_paired(rollout: dict[str, dict]) -> bool:
    counts = {len(_rollout_round_steps(rec)) for rec in rollout.values()}
    return len(counts) == 1 and min(counts) > 1


def _rollout_ratio(rollout: dict[str, dict], arm: str) -> tuple[float, float, float]:
    """Decode speed against BF16's at the same batch, (ratio, lo, hi) (module docstring); NaN without both."""
    if arm not in rollout or BF16 not in rollout:
        return math.nan, math.nan, math.nan
    if arm == BF16:
        return 1.0, 1.0, 1.0
    if _rollout_paired(rollout):
        per = [b / a for a, b in zip(_rollout_round_steps(rollout[arm]), _rollout_round_steps(rollout[BF16]),
                                     strict=True)]
        return statistics.median(per), min(per), max(per)
    a, b = rollout[arm]["step_ms"], rollout[BF16]["step_ms"]
    if all(k in s for s in (a, b) for k in ("p10", "p90")):
        return b["median"] / a["median"], b["p10"] / a["p90"], b["p90"] / a["p10"]
    return b["median"] / a["median"], math.nan, math.nan


def _rollout_flag(rec: dict) -> str:
    """The trust rule on a rollout record's decode step times (the median round's, with rounds); records
    without per-step times are not flagged."""
    steps = rec.get("step_ms_all")
    if not steps:
        return ""
    t = timing_summary(steps)
    return _flag(t["n"], t["spread"], math.nan)


def _rollout_ratio_text(r, flagged: set) -> str:
    """'1.12x (0.95-1.30)': the table's rollout ratio vs BF16 and its range, ⚠ when either row is flagged."""
    v, lo, hi = r.rollout_ratio_vs_bf16, r.rollout_ratio_vs_bf16_lo, r.rollout_ratio_vs_bf16_hi
    if _nan(v):
        return "n/a"
    if r.arm == BF16:
        return f"{v:.2f}x"
    return f"{v:.2f}x" + ("" if _nan(lo) else f" ({lo:.2f}-{hi:.2f})") + (" ⚠" if {r.arm, BF16} & flagged else "")


def _step_range(step_ms: dict) -> str:
    return f"{step_ms['p10']:.3f}-{step_ms['p90']:.3f}" if "p10" in step_ms and "p90" in step_ms else "n/a"


def _rollout_section(df: pd.DataFrame, rollout: dict[str, dict]) -> list[str]:
    any_rec = next(iter(rollout.values()))
    flagged = set(df.loc[df["rollout_flag"] != "", "arm"])
    rows = [[r.arm, _fmt(r.rollout_tokens_per_s, ",.0f"),
             _rollout_ratio_text(r, flagged),
             _fmt(r.rollout_step_ms, ",.3f"),
             _step_range(rollout[r.arm]["step_ms"]),
             str(rollout[r.arm]["step_ms"].get("n", "?")), _fmt(100 * r.rollout_roofline_frac, ".1f") + "%",
             "graphs" if rollout[r.arm].get("cuda_graphs") else "eager", r.rollout_flag or "ok"]
            for r in df.itertuples() if r.arm in rollout]
    return ["## Rollout (decode) throughput", "",
            f"`python -m minite bench-sampler`: `{any_rec.get('model')}` ({any_rec.get('layers')} layers), "
            f"{any_rec.get('batch')} sequences, {any_rec.get('prompt_len')}-token prompts, "
            f"{any_rec.get('new_tokens')} new tokens, on {any_rec.get('device')} (this run: {run_label(rollout)}). "
            + (f"Measured in {len(_rollout_round_steps(any_rec))} rounds, every arm once per round; each "
               "row is the arm's median round by decode tokens/s, and the ratio vs BF16 is the median of the "
               "rounds' ratios of median decode steps, with their range. " if _rollout_paired(rollout) else
               "Every decode step is timed; the ratio's range pairs the arms' 10th and 90th percentile steps. ")
            + "Roofline: tokens/s if every "
            "decode step only read the weights it uses at the copy bandwidth measured in the same run.", "",
            _md_table(["arm", "decode tokens/s", "vs BF16", "step (ms, median)", "step p10-p90 (ms)", "steps",
                       "of roofline", "decode path", "trust"], rows)]


def to_markdown(df: pd.DataFrame, learner: dict[str, dict], profile: str,
                reference: dict[str, dict] | None = None, reference_dir: str | None = None,
                rollout: dict[str, dict] | None = None) -> str:
    devices = sorted(set(df["device"].astype(str)))
    model, layers = df["model"].iloc[0], df["layers"].iloc[0]
    out = [f"# Learner throughput ({profile} profile)", "",
           f"Complete learner updates (forward, backward, optimizer step) of `{model}` "
           f"({layers} layers) on {', '.join(devices)}; measured by `python -m minite bench-learner` "
           f"(this run: {run_label(learner)}).", "",
           "tokens/s is tokens per update over the median step time; the interquartile range, the number of "
           "timed steps and the spread (interquartile range / median of the step times) say how steady the "
           "machine was. " + _ratio_text(df) + " Trust rule: " + TRUST_RULE + ".", ""]
    if len(devices) > 1:
        out += ["**Warning: the arms were measured on different devices; the ratios compare devices as "
                "well as arms.**", ""]
    out.append(_md_table(THROUGHPUT_HEADER, _throughput_rows(df)))
    out += _split_section(df)
    if rollout:
        out += ["", *_rollout_section(df, rollout)]
    if reference:
        out += ["", *_reference_section(df, reference, reference_dir)]
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
            "## Provenance", "", _provenance_table(learner), ""]
    return "\n".join(out)


def _ratio_text(df: pd.DataFrame) -> str:
    rounds = set(df["n_rounds"])
    if len(rounds) == 1 and min(rounds) > 1:
        return (f"Measured in {min(rounds)} rounds, every arm once per round, one after another (rotated "
                "from round to round): each row is the arm's median round by tokens/s (the lower middle one "
                "for an even count), and rounds gives how far the rounds' tokens/s differ (max - min over the "
                "median). Ratios are the median of the ratios within each round, with their range over the "
                "rounds.")
    return ("Ratios are ratios of medians, with a range from the per-step distributions (this arm's lower "
            "quartile over the other's upper, and the reverse).")


def _provenance_table(learner: dict[str, dict]) -> str:
    return _md_table(["arm", "sha", "device", "torch", "triton", "GPU driver", "date", "command"],
                     [[arm, *(_recorded(rec, k) for k in ("sha", "device", "torch", "triton", "gpu_driver", "date")),
                       f"`{rec.get('command', '?')}`"] for arm, rec in learner.items()])


def _recorded(rec: dict, key: str) -> str:
    """A provenance field: 'not recorded' (older results lack the key), 'none' (recorded as absent: no
    triton, no GPU driver on a CPU run) or its value."""
    if key not in rec:
        return "not recorded"
    return "none" if rec[key] is None else str(rec[key])


def _reference_section(df: pd.DataFrame, reference: dict[str, dict], reference_dir: str | None) -> list[str]:
    """The committed reference run of the same profile, labelled with its own sha, device and date."""
    ref = throughput_table(reference)
    label = f"reference ({run_label(reference)})"
    out = [f"## Beside the {label}", "",
           f"The committed reference run{f' (`{reference_dir}`)' if reference_dir else ''}, measured by the "
           "commit and on the device named above, not by this run."]
    same = {(str(r["model"]), str(r["layers"])) for r in reference.values()} == \
        {(str(m), str(n)) for m, n in zip(df["model"], df["layers"], strict=True)}
    if not same:
        out.append(" **It measured another model slice: its numbers are not comparable with this run's.**")
    return out + ["", _md_table(THROUGHPUT_HEADER, _throughput_rows(ref))]


def to_latex(df: pd.DataFrame) -> str:
    flagged = set(df.loc[df["flag"] != "", "arm"])
    t = pd.DataFrame({
        "Arm": df["arm"],
        "Tokens/s": df["tokens_per_s"].map("{:,.0f}".format),
        "IQR": [f"{a:,.0f}--{b:,.0f}"
                for a, b in zip(df["tokens_per_s_q25"], df["tokens_per_s_q75"], strict=True)],
        "n": df["n_steps"],
        "Rounds": df["n_rounds"],
        "vs BF16": [_latex_ratio(v, lo, hi, {a, BF16} & flagged) for a, v, lo, hi in
                    zip(df["arm"], df["ratio_vs_bf16"], df["ratio_vs_bf16_lo"], df["ratio_vs_bf16_hi"], strict=True)],
        "vs naive": [_latex_ratio(v, lo, hi, {a, NAIVE} & flagged) for a, v, lo, hi in
                     zip(df["arm"], df["ratio_vs_naive"], df["ratio_vs_naive_lo"], df["ratio_vs_naive_hi"],
                         strict=True)],
        "Step (ms)": df["step_ms"].map("{:,.1f}".format),
        "Peak mem (GB)": df["peak_mem_gb"].map(lambda v: _fmt(v, ".2f", "--")),
        "Trust": df["flag"].map(lambda f: f or "ok"),
    })
    sty = t.style.hide(axis="index").format(escape="latex", subset=["Arm", "Trust"])
    return sty.to_latex(hrules=True, column_format="l" + "r" * (t.shape[1] - 2) + "l") + \
        f"% ratios: {_ratio_text(df)} {TRUST_RULE} (here: a dagger)\n" + \
        f"% paper ({PAPER['device']}, {PAPER['model']}): {PAPER['tokens_per_s']:,.0f} tokens/s, " \
        f"{PAPER['ratio_vs_bf16']:.2f}x BF16, {PAPER['ratio_vs_naive']:.2f}x naive TE NVFP4\n"


def _latex_ratio(v, lo, hi, untrusted=False) -> str:
    if _nan(v):
        return "--"
    if lo == hi == 1.0:                                     # an arm against itself: exactly 1
        return f"{v:.2f}"
    return f"{v:.2f} ({lo:.2f}--{hi:.2f})" + (r"$^\dagger$" if untrusted else "")


def write_throughput_table(results_dir, arms, out_prefix=None, profile: str | None = None,
                           reference_dir=None) -> pd.DataFrame:
    """Read ``<results_dir>/<arm>/learner.json`` (and ``rollout.json`` where present) for each arm; write
    ``<out_prefix>.{csv,md,tex}`` (default ``<results_dir>/throughput_table``). With ``reference_dir`` (a
    committed reference run of the same profile) the markdown sets its rows beside this run's, labelled.
    Returns the table."""
    results_dir = Path(results_dir)
    out_prefix = Path(out_prefix) if out_prefix else results_dir / "throughput_table"
    learner = load_learner(results_dir, arms)
    rollout = load_rollout(results_dir, arms)
    df = throughput_table(learner, rollout)
    reference = load_learner(reference_dir, arms, missing="skip") if reference_dir else None
    md = to_markdown(df, learner, profile or results_dir.name, reference or None,
                     str(reference_dir) if reference_dir else None, rollout)
    write_csv(out_prefix.with_suffix(".csv"), df)
    write_text(out_prefix.with_suffix(".md"), md)
    write_text(out_prefix.with_suffix(".tex"), to_latex(df))
    return df
