"""Throughput in rounds (the learner's ``bench-learner``, the rollout's ``bench-sampler``): every arm measured
once per round, the arms one after another, then the next round; ratios paired within a round.

Why: an arm's update time can move between two runs of the same code on the same machine by more than its
own spread within a run (on an H200, miniTE's took 562 and 499 ms per update in two pipeline runs of one
commit, while BF16's stayed within 0.4%). One run per arm, the arms one after another, then measures the arms
at different moments of the machine's drift, and a ratio of two such runs carries that drift. Rounds measure
every arm at each moment, and the ratio of two arms is taken within each round.

Layout (``BENCHES``): round k of an arm is ``<results>/<arm>/learner_rounds/round<k>.json`` (a
``bench-learner`` record; ``rollout_rounds/`` for ``bench-sampler``); ``merge_rounds`` makes the arm's
``learner.json`` (``rollout.json``) from them: the record of its median round by tokens/s (decode tokens/s; the
lower middle one for an even count), so tokens/s, step times, split, telemetry and provenance all come from
one real run, with ``rounds`` listing every round's figures. ``minite.report.tables`` then takes each ratio
as the median of the per-round ratios, with their range, and flags a learner arm whose rounds disagree by
more than the spread limit.

The pipeline's rules (workflow/rules/learner.smk, ``rounds:`` in the bench_learner or bench_sampler job) run
the rounds, round k starting at arm k mod n, so no arm always runs first or last.

Resume: the job keeps a copy of every finished run in ``<results>/.partial/<rounds dir>/`` (snakemake deletes
a failed job's outputs, not that). ``rounds_todo`` starts each attempt: rounds whose every arm finished in an
earlier attempt of the same job (same bench-learner arguments, same clean commit) are restored and kept; the
runs of every other round are done again, all arms of the round, so a round never pairs runs of two attempts.
A successful job removes the copies: the next job measures every round afresh.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from minite.provenance import atomic_path, git_sha, write_json
from minite.report.load import ResultError, load_learner, load_rollout


@dataclass(frozen=True)
class Bench:
    command: str       # minite's subcommand
    record: str        # the merged record, in the arm's directory
    rounds_dir: str    # its rounds, in the arm's directory
    rate: str          # the record's tokens/s, which picks the median round
    load: object       # minite.report.load's reader of such records (results_dir, arms, missing, rel)


BENCHES = {"learner": Bench("bench-learner", "learner.json", "learner_rounds", "tokens_per_s", load_learner),
           "sampler": Bench("bench-sampler", "rollout.json", "rollout_rounds", "decode_tokens_per_s", load_rollout)}
LEARNER = BENCHES["learner"]


def partial_dir(results_dir, bench: Bench = LEARNER) -> Path:
    """Finished runs of an unfinished job (under the results directory)."""
    return Path(results_dir) / ".partial" / bench.rounds_dir


def round_file(k: int, bench: Bench = LEARNER) -> str:
    """Round k's record, relative to the arm's directory."""
    return f"{bench.rounds_dir}/round{k}.json"


def merge_rounds(records: list[dict], bench: Bench = LEARNER) -> dict:
    """One arm's round records (in round order) -> its merged record: the median round's record, with
    ``rounds`` = every round's tokens/s, step times and date, and ``median_round`` its index."""
    if not records:
        raise ResultError("no rounds to merge")
    setups = {(str(r["model"]), str(r["layers"]), str(r.get("arm"))) for r in records}
    if len(setups) > 1:
        raise ResultError(f"rounds of different arms or model slices {sorted(setups)} cannot be merged")
    tps = [float(r[bench.rate]) for r in records]
    mid = sorted(range(len(tps)), key=tps.__getitem__)[(len(tps) - 1) // 2]   # the lower middle when even
    out = dict(records[mid])
    out["median_round"] = mid
    # step_ms: bench-learner's median update (ms), bench-sampler's decode-step statistics ({median, p10, ...})
    out["rounds"] = [{"round": k, "tokens_per_s": tps[k], "step_ms": r["step_ms"],
                      "step_ms_stats": r.get("step_ms_stats"), "date": r.get("date")}
                     for k, r in enumerate(records)]
    out["rounds_note"] = (f"{len(records)} rounds, every arm once per round (minite.report.rounds); this "
                          f"record is round {mid}'s, the median round by tokens/s")
    return out


def write_merged(results_dir, arms: list[str], rounds: int, bench: Bench = LEARNER) -> dict[str, dict]:
    """Merge each arm's rounds into ``<results_dir>/<arm>/<bench.record>`` (atomically; nothing is written
    unless every round of every arm reads back as a valid record)."""
    per_round = [bench.load(results_dir, arms, missing="raise", rel=round_file(k, bench)) for k in range(rounds)]
    merged = {arm: merge_rounds([per_round[k][arm] for k in range(rounds)], bench) for arm in arms}
    for arm, rec in merged.items():
        write_json(Path(results_dir) / arm / bench.record, rec)
    return merged


def parse_plan(plan: str) -> list[tuple[str, int]]:
    """'arm:k arm:k ...' (the rule's run order) -> [(arm, k), ...]."""
    runs = []
    for item in plan.split():
        arm, sep, k = item.rpartition(":")
        if not sep or not arm or not k.isdigit():
            raise ResultError(f"bad run {item!r} in the plan: want ARM:ROUND")
        runs.append((arm, int(k)))
    return runs


def _copy(src: Path, dst: Path) -> None:
    """Copy a record so that an interrupted copy leaves no truncated file behind."""
    with atomic_path(dst, "wb") as f:
        f.write(src.read_bytes())


def rounds_todo(results_dir, plan: list[tuple[str, int]], key: str, bench: Bench = LEARNER
                ) -> tuple[list[tuple[str, int]], list[int]]:
    """Start an attempt of the rounds job: -> (the runs still to do, in plan order; the rounds kept).

    ``key`` names the job's setup (its command and arguments). A round is kept when the copies of an earlier
    attempt hold all of its arms' runs and that attempt had the same key and the same commit; its records are
    copied back to ``<arm>/<rounds dir>/round<k>.json``. Without a clean commit (a '-dirty' or unknown sha)
    nothing is kept or copied. Any other earlier copies are removed."""
    partial = partial_dir(results_dir, bench)
    sha = git_sha()
    want = {"key": key, "sha": sha}
    stamp = partial / "job.json"
    try:
        same = json.loads(stamp.read_text()) == want
    except (OSError, ValueError):
        same = False
    resumable = not (sha == "unknown" or sha.endswith("-dirty"))
    if not (same and resumable):
        shutil.rmtree(partial, ignore_errors=True)
        if resumable:
            with atomic_path(stamp) as f:
                json.dump(want, f)
    arms = sorted({arm for arm, _ in plan})
    kept = sorted({k for _, k in plan if same and resumable
                   and all((partial / arm / f"round{k}.json").is_file() for arm in arms)})
    for k in kept:
        for arm in arms:
            _copy(partial / arm / f"round{k}.json", Path(results_dir) / arm / round_file(k, bench))
    return [(arm, k) for arm, k in plan if k not in kept], kept


def run_rounds(results_dir, plan: list[tuple[str, int]], runner: list[str], args: list[str],
               bench: Bench = LEARNER) -> int:
    """The rounds job: ``runner <bench command> --arm A ARGS --out <results>/A/<rounds dir>/round<k>.json`` for
    each (A, k) of the plan that ``rounds_todo`` leaves, each finished run copied for a later attempt.
    Returns the first failing run's exit status (0: all done)."""
    todo, kept = rounds_todo(results_dir, plan, key=shlex.join([*runner, bench.command, *args]), bench=bench)
    partial = partial_dir(results_dir, bench)
    for k in kept:
        print(f"== round {k}: kept from an earlier attempt of this job (same commit and arguments)", flush=True)
    for arm, k in todo:
        print(f"== round {k}: {arm}", flush=True)
        out = Path(results_dir) / arm / round_file(k, bench)
        rc = subprocess.run([*runner, bench.command, "--arm", arm, *args, "--out", str(out)]).returncode
        if rc:
            return rc
        if (partial / "job.json").is_file():
            _copy(out, partial / arm / f"round{k}.json")
    return 0


def drop_partial(results_dir, bench: Bench = LEARNER) -> None:
    """The job finished: its copies are not needed (the next job measures every round afresh)."""
    shutil.rmtree(partial_dir(results_dir, bench), ignore_errors=True)
    parent = partial_dir(results_dir, bench).parent
    if parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
