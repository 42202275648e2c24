"""Learner throughput in rounds: every arm measured once per round, the arms one after another, then the
next round; ratios paired within a round.

Why: an arm's update time can move between two runs of the same code on the same machine by more than its
own spread within a run (on an H200, miniTE's took 562 and 499 ms per update in two pipeline runs of one
commit, while BF16's stayed within 0.4%). One run per arm, the arms one after another, then measures the arms
at different moments of the machine's drift, and a ratio of two such runs carries that drift. Rounds measure
every arm at each moment, and the ratio of two arms is taken within each round.

Layout: round k of an arm is ``<results>/<arm>/learner_rounds/round<k>.json`` (a ``bench-learner`` record);
``merge_rounds`` makes the arm's ``learner.json`` from them: the record of its median round by tokens/s (the
lower middle one for an even count), so tokens/s, step times, split, telemetry and provenance all come from
one real run, with ``rounds`` listing every round's figures. ``minite.report.tables`` then takes each ratio
as the median of the per-round ratios, with their range, and flags an arm whose rounds disagree by more than
the spread limit.

The pipeline's rule (workflow/rules/learner.smk, ``rounds:`` in the bench_learner job) runs the rounds, round k
starting at arm k mod n, so no arm always runs first or last.
"""
from __future__ import annotations

from pathlib import Path

from minite.provenance import write_json
from minite.report.load import ResultError, load_learner


def round_file(k: int) -> str:
    """Round k's record, relative to the arm's directory."""
    return f"learner_rounds/round{k}.json"


def merge_rounds(records: list[dict]) -> dict:
    """One arm's round records (in round order) -> its learner.json record: the median round's record, with
    ``rounds`` = every round's figures and ``median_round`` its index."""
    if not records:
        raise ResultError("no rounds to merge")
    setups = {(str(r["model"]), str(r["layers"]), str(r.get("arm"))) for r in records}
    if len(setups) > 1:
        raise ResultError(f"rounds of different arms or model slices {sorted(setups)} cannot be merged")
    tps = [float(r["tokens_per_s"]) for r in records]
    mid = sorted(range(len(tps)), key=tps.__getitem__)[(len(tps) - 1) // 2]   # the lower middle when even
    out = dict(records[mid])
    out["median_round"] = mid
    out["rounds"] = [{"round": k, "tokens_per_s": float(r["tokens_per_s"]), "step_ms": float(r["step_ms"]),
                      "step_ms_stats": r.get("step_ms_stats"), "date": r.get("date")}
                     for k, r in enumerate(records)]
    out["rounds_note"] = (f"{len(records)} rounds, every arm once per round (minite.report.rounds); this "
                          f"record is round {mid}'s, the median round by tokens/s")
    return out


def write_merged(results_dir, arms: list[str], rounds: int) -> dict[str, dict]:
    """Merge each arm's rounds into ``<results_dir>/<arm>/learner.json`` (atomically; nothing is written
    unless every round of every arm reads back as a valid record)."""
    per_round = [load_learner(results_dir, arms, rel=round_file(k)) for k in range(rounds)]
    merged = {arm: merge_rounds([per_round[k][arm] for k in range(rounds)]) for arm in arms}
    for arm, rec in merged.items():
        write_json(Path(results_dir) / arm / "learner.json", rec)
    return merged
