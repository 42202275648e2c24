"""Read the results tree written by the jobs (layout: docs/ENGINES.md, "Results layout").

Every loader takes the profile's results directory (``results/<profile>``) and the arms to read, and
raises a clear error on a missing or malformed file. ``missing="skip"`` (what the notebooks use) leaves
out arms whose file does not exist yet instead of raising, so a notebook shows whatever has been run.

A run of another seed than 0 has its own directory, ``<arm>_seed<N>`` (``run_name``); the RL loaders take
such run names where they take arms, and ``parse_run`` gives a run's (arm, seed) back.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pandas as pd

from minite import provenance

#: The learner.json keys the throughput table needs (bench-learner writes them; see docs/ENGINES.md).
LEARNER_KEYS = ("tokens_per_s", "step_ms", "peak_mem_gb", "model", "layers", "device", "sha")


class ResultError(ValueError):
    """A result file is missing a field the report needs, or holds a non-finite number."""


def read_json(path: Path):
    """A result file's JSON; a torn or corrupt file (a job killed mid-write) is a ResultError naming it."""
    return provenance.read_json(path, "rerun the job that writes it", ResultError)


_SEED_RUN = re.compile(r"^(?P<arm>[a-z0-9_]+?)_seed(?P<seed>[0-9]+)$")


def run_name(arm: str, seed: int = 0) -> str:
    """The results directory of an arm's run with ``seed``: ``<arm>`` for seed 0, else ``<arm>_seed<N>``."""
    return arm if int(seed) == 0 else f"{arm}_seed{int(seed)}"


def parse_run(run: str) -> tuple[str, int]:
    """``run_name`` backwards: ``bf16_seed1`` -> ("bf16", 1), ``bf16`` -> ("bf16", 0)."""
    m = _SEED_RUN.match(run)
    return (m["arm"], int(m["seed"])) if m else (run, 0)


def _paths(results_dir, arms, rel: str, missing: str) -> dict[str, Path]:
    if missing not in ("raise", "skip"):
        raise ValueError(f"missing must be 'raise' or 'skip', got {missing!r}")
    out = {}
    for arm in arms:
        p = Path(results_dir) / arm / rel
        if p.exists():
            out[arm] = p
        elif missing == "raise":
            raise FileNotFoundError(f"{p} does not exist (run the pipeline target that makes it first)")
        else:
            warnings.warn(f"{p} not found: arm {arm!r} left out", stacklevel=3)
    return out


def load_learner(results_dir, arms, missing: str = "raise", rel: str = "learner.json") -> dict[str, dict]:
    """arm -> the learner.json record, provenance fields (``provenance: {...}``) lifted to the top level.
    ``rel``: another bench-learner record of the arm's directory (a round: ``minite.report.rounds``)."""
    out = {}
    for arm, path in _paths(results_dir, arms, rel, missing).items():
        rec = read_json(path)
        if not isinstance(rec, dict):
            raise ResultError(f"{path}: expected a JSON object, got {type(rec).__name__}")
        rec = {**rec.get("provenance", {}), **{k: v for k, v in rec.items() if k != "provenance"}}
        absent = [k for k in LEARNER_KEYS if k not in rec]
        if absent:
            raise ResultError(f"{path}: missing keys {absent} (bench-learner writes {list(LEARNER_KEYS)})")
        for key in ("tokens_per_s", "step_ms"):
            v = rec[key]
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ResultError(f"{path}: {key} must be a positive finite number, got {v!r}")
        out[arm] = rec
    return out


def load_rollout(results_dir, arms, missing: str = "skip", rel: str = "rollout.json") -> dict[str, dict]:
    """arm -> the rollout.json record of ``bench-sampler`` (provenance lifted to the top level); arms without
    one are left out (the rollout columns are optional). ``rel``: another bench-sampler record of the arm's
    directory (a round: ``minite.report.rounds``)."""
    out = {}
    for arm, path in _paths(results_dir, arms, rel, missing).items():
        rec = read_json(path)
        if not isinstance(rec, dict) or "decode_tokens_per_s" not in rec or "roofline_frac" not in rec:
            raise ResultError(f"{path}: not a bench-sampler record (decode_tokens_per_s, roofline_frac)")
        out[arm] = {**rec.get("provenance", {}), **{k: v for k, v in rec.items() if k != "provenance"}}
    return out


def load_stability(results_dir, arms, missing: str = "raise") -> pd.DataFrame:
    """All arms' stability.jsonl as one long frame: ``arm``, ``step`` and every logged field, nested
    objects flattened with '/' (``{"mismatch": {"k3": ..}}`` -> ``mismatch/k3``). A torn last line (a job
    killed mid-write) is dropped with a warning; a torn line elsewhere is an error."""
    frames = []
    for arm, path in _paths(results_dir, arms, "stability.jsonl", missing).items():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        records = []
        for i, ln in enumerate(lines):
            try:
                records.append(json.loads(ln))
            except json.JSONDecodeError as e:
                if i == len(lines) - 1:
                    warnings.warn(f"{path}: last line is incomplete, ignored", stacklevel=2)
                    continue
                raise ResultError(f"{path}:{i + 1}: not JSON ({e})") from e
        df = pd.json_normalize(records, sep="/")
        if len(df) and "step" not in df:
            raise ResultError(f"{path}: records have no 'step' field")
        if "arm" in df and len(df) and set(df["arm"].astype(str)) != {parse_run(arm)[0]}:
            raise ResultError(f"{path}: holds records of arms {sorted(set(df['arm']))}, expected only "
                              f"{parse_run(arm)[0]!r}")
        df = df.drop(columns="arm", errors="ignore")
        df.insert(0, "arm", arm)
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=["arm", "step"])
    return pd.concat(frames, ignore_index=True)


def load_stability_summary(results_dir, arms, missing: str = "raise") -> dict[str, dict]:
    return {arm: read_json(p) for arm, p in _paths(results_dir, arms, "stability_summary.json", missing).items()}


def load_evals(results_dir, arms, missing: str = "raise") -> pd.DataFrame:
    """All arms' evals.csv, with an ``arm`` column (overwriting the file's own, which must agree)."""
    frames = []
    for arm, path in _paths(results_dir, arms, "evals.csv", missing).items():
        df = pd.read_csv(path)
        if "arm" in df and len(df) and set(df["arm"].astype(str)) != {parse_run(arm)[0]}:
            raise ResultError(f"{path}: holds rows for arms {sorted(set(df['arm']))}, expected only "
                              f"{parse_run(arm)[0]!r}")
        df["arm"] = arm
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["arm"])


def load_heldout(results_dir, runs, missing: str = "raise") -> pd.DataFrame:
    """Held-out accuracy per run and number of updates: columns run, arm, seed, updates, mean_at_k, source.
    From the in-run evaluation in stability.jsonl (``heldout_mean_at_k``, ``metrics.heldout_every``) when the
    run has one, else from the eval job's evals.csv (its ``step`` = updates); a run with neither has no rows."""
    frames = []
    for run in runs:
        arm, seed = parse_run(run)
        stab = load_stability(results_dir, [run], missing=missing)
        if "heldout_mean_at_k" in stab and stab["heldout_mean_at_k"].notna().any():
            d = stab[stab["heldout_mean_at_k"].notna()]
            frames.append(pd.DataFrame({"updates": d["heldout_updates"].astype(int),
                                        "mean_at_k": d["heldout_mean_at_k"], "source": "in-run"}))
        elif (Path(results_dir) / run / "evals.csv").exists():
            ev = load_evals(results_dir, [run])
            acc = next((c for c in ev.columns if str(c).startswith(("mean_at_", "mean@"))), None) or column(
                ev, "accuracy")
            frames.append(pd.DataFrame({"updates": ev[column(ev, "step")].astype(int), "mean_at_k": ev[acc],
                                        "source": "evals.csv"}))
        else:
            continue
        frames[-1].insert(0, "seed", seed)
        frames[-1].insert(0, "arm", arm)
        frames[-1].insert(0, "run", run)
    cols = ["run", "arm", "seed", "updates", "mean_at_k", "source"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


def load_kernels(results_dir) -> pd.DataFrame:
    path = Path(results_dir) / "kernels.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (run the kernel_bench target on a GPU)")
    return pd.read_csv(path)


def load_diagnostics(results_dir, arms, missing: str = "raise") -> dict[str, dict]:
    """arm -> {"mismatch": dict, "layers": DataFrame, "attribution": DataFrame} (each present file)."""
    out = {}
    for arm, path in _paths(results_dir, arms, "diagnostics/mismatch.json", missing).items():
        d = {"mismatch": read_json(path)}
        for name in ("layers", "attribution"):
            p = path.parent / f"{name}.csv"
            if p.exists():
                d[name] = pd.read_csv(p)
        out[arm] = d
    return out


def column(df: pd.DataFrame, names: str | tuple[str, ...], required: bool = True) -> str | None:
    """The column holding a metric, trying each of ``names`` in turn: the name itself, else the one column
    ending in '/name' or '.name' (a metric logged inside a group, e.g. ``mismatch/k3``)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        if name in df.columns:
            return name
        hits = [c for c in df.columns if str(c).endswith(("/" + name, "." + name))]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise ResultError(f"several columns match {name!r}: {hits}")
    if not required:
        return None
    raise ResultError(f"no column for {' / '.join(names)}: columns are {list(df.columns)}")
