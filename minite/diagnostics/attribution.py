"""Attribution: how much of a naive arm's mismatch does each cause contribute?

Start from a naive arm (``naive_te_nvfp4`` by default; any arm can be the base, e.g.
``naive_te_nvfp4_blanket``) and switch causes, one at a time, to their ``minite_nvfp4`` setting (values
read from configs/arms/minite_nvfp4.yaml, so they follow the YAML):

    weights         the sampler uses the trainer's NVFP4 weight codes instead of re-quantizing the BF16 sync
                    with ModelOpt's formula / 1x16 blocks / shared fused-shard scales. When both engines keep
                    the same high-precision modules this is the real thing: ``sync: nvfp4_codes`` +
                    ``sampler.weights: from_trainer``. While ``high_precision`` still differs (the blanket
                    variant's trainer quantizes the router, the sampler does not), the arm schema forbids code
                    sync, so the sampler instead re-quantizes the BF16 sync with the trainer's exact weight
                    quantizer (te formula, 16x16 tiles, per-shard scales): deterministic, hence the same codes
                    for every module both engines quantize. Every subset is a valid arm.
    activations     per-token (row) activation scaling with formula te in both engines, instead of the
                    trainer's per-tensor amax and the sampler's static calibrated vLLM scales.
    gemm            the same batch-invariant W4A4 kernel in both engines (instead of emulated BF16 GEMMs), and
                    batch-invariant BF16 GEMMs for the high-precision modules (``hp_gemm``).
    high_precision  the same high-precision exceptions in both engines (the router stays BF16 in the trainer).
    non_gemm        the same non-GEMM ops (upstream transformers numerics in the sampler too) and the same
                    batch-invariant attention in both engines.

The causes attributed are those that change the base arm (``active_causes``): the default naive arm is
deployed as Megatron-core deploys TE (router BF16 outside TE, as in the sampler), so it already has the
aligned high-precision exceptions and ``high_precision`` is no cause of its gap (4 causes, 16 measured arms);
the blanket variant quantizes the router in the trainer and has all five (32 measured arms).
With every active cause switched, the arm equals ``minite_nvfp4`` (checked: ``all_causes_arm``).

Reported for a metric v (k3 by default) of the arm with cause set S applied, v(S):
    forward   causes in the order above: delta_i = v(S_{i-1}) - v(S_i)
    reverse   the opposite order
    shapley   phi_i = sum over S not containing i of |S|! (n-|S|-1)! / n! * (v(S) - v(S + i)): the average
              of the forward deltas over all n! orders; exact from the 2**n subset values.
Each order's deltas sum to v(naive) - v(aligned) by construction (telescoping; Shapley efficiency);
``share`` = delta / (v(naive) - v(aligned)). A negative delta means that switching the cause alone (in
that order) *increased* the mismatch — interactions are real, which is why all three views are reported.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import pandas as pd

from minite.engines.arms import Arm, load_arm


@functools.cache
def _arm(name: str) -> Arm:  # arms are frozen: load (and schema-validate) each YAML once
    return load_arm(name)


CAUSES = ("weights", "activations", "gemm", "high_precision", "non_gemm")
ATTRIBUTION_COLUMNS = ["cause", "order", "k3_before", "k3_after", "delta", "share"]


NAIVE = "naive_te_nvfp4"   # the default base arm


def cause_overrides(causes: frozenset[str] | set[str], aligned: Arm | None = None, naive: Arm | None = None) -> dict:
    """The ``Arm.override`` changes that switch ``causes`` of the naive arm to the aligned setting."""
    unknown = set(causes) - set(CAUSES)
    if unknown:
        raise ValueError(f"unknown causes {sorted(unknown)}; known: {', '.join(CAUSES)}")
    a = (aligned or _arm("minite_nvfp4")).raw
    n = naive or _arm(NAIVE)
    ch: dict = {}
    if "weights" in causes:
        ch["trainer.weights"] = a["trainer"]["weights"]
        hp = (a["trainer"]["high_precision"], a["sampler"]["high_precision"]) if "high_precision" in causes \
            else (n.trainer.high_precision, n.sampler.high_precision)
        if set(hp[0]) == set(hp[1]):
            ch.update({"sync": "nvfp4_codes", "sampler.weights": "from_trainer"})
        else:  # code sync needs equal high-precision sets: re-quantize with the trainer's quantizer instead
            ch["sampler.weights"] = a["trainer"]["weights"]
    if "activations" in causes:
        ch["trainer.activations"] = a["trainer"]["activations"]
        ch["sampler.activations"] = a["sampler"]["activations"]
    if "gemm" in causes:
        ch["trainer.gemm"], ch["sampler.gemm"] = a["trainer"]["gemm"], a["sampler"]["gemm"]
        for role in ("trainer", "sampler"):
            ch[f"{role}.hp_gemm"] = a[role].get("hp_gemm", "bf16")
    if "high_precision" in causes:
        ch["trainer.high_precision"] = a["trainer"]["high_precision"]
        ch["sampler.high_precision"] = a["sampler"]["high_precision"]
    if "non_gemm" in causes:
        for role in ("trainer", "sampler"):
            ch[f"{role}.non_gemm"] = a[role]["non_gemm"]
            ch[f"{role}.attention"] = a[role]["attention"]
    return ch


def subset_name(causes) -> str:
    return "naive__" + "__".join(c for c in CAUSES if c in causes) if causes else "naive"


def subset_arm(causes, naive: Arm | None = None, aligned: Arm | None = None) -> Arm:
    """The naive arm with ``causes`` switched to the aligned setting (a valid, re-validated Arm)."""
    naive = naive or _arm(NAIVE)
    if not causes:
        return naive
    return naive.override(cause_overrides(frozenset(causes), aligned, naive), name=subset_name(causes))


def same_recipe(a: Arm, b: Arm) -> bool:
    """Both arms configure both engines identically (name, description and calibration aside)."""
    return a.sync == b.sync and a.trainer == b.trainer and a.sampler == b.sampler


def active_causes(naive: Arm | None = None, aligned: Arm | None = None) -> tuple[str, ...]:
    """The causes (in ``CAUSES`` order) whose switch alone changes the base arm: the ones its gap can have."""
    naive = naive or _arm(NAIVE)
    return tuple(c for c in CAUSES if not same_recipe(subset_arm(frozenset({c}), naive, aligned), naive))


def all_causes_arm(naive: Arm | None = None) -> Arm:
    arm = subset_arm(frozenset(active_causes(naive)), naive)
    if not same_recipe(arm, _arm("minite_nvfp4")):  # the attribution must end exactly at the aligned arm
        raise AssertionError(f"{arm.name}: naive + all causes != minite_nvfp4: update attribution.cause_overrides")
    return arm


def _rows_for_order(order_name, order, v, total):
    rows, applied = [], frozenset()
    for c in order:
        before, after = v(applied), v(applied | {c})
        applied = applied | {c}
        d = before - after
        rows.append({"cause": c, "order": order_name, "k3_before": before, "k3_after": after, "delta": d,
                     "share": d / total if total else float("nan")})
    return rows


def shapley_values(v: Callable[[frozenset], float], causes=CAUSES) -> dict[str, float]:
    """Exact Shapley values of the *reduction* v(S) - v(S + i) (sum = v(empty) - v(all))."""
    n = len(causes)
    phi = {}
    for c in causes:
        others = [x for x in causes if x != c]
        tot = 0.0
        for r in range(n):
            w = math.factorial(r) * math.factorial(n - r - 1) / math.factorial(n)
            for s in itertools.combinations(others, r):
                s = frozenset(s)
                tot += w * (v(s) - v(s | {c}))
        phi[c] = tot
    return phi


def attribute(measure: Callable[[frozenset], float], causes=CAUSES, shapley: bool = True) -> pd.DataFrame:
    """attribution table (``ATTRIBUTION_COLUMNS``) from ``measure(cause_subset) -> metric`` (memoised)."""
    cache: dict[frozenset, float] = {}

    def v(s: frozenset) -> float:
        s = frozenset(s)
        if s not in cache:
            cache[s] = float(measure(s))
        return cache[s]

    start, end = v(frozenset()), v(frozenset(causes))
    total = start - end
    rows = _rows_for_order("forward", list(causes), v, total) + _rows_for_order("reverse", list(causes)[::-1], v, total)
    if shapley:
        for c, p in shapley_values(v, causes).items():
            rows.append({"cause": c, "order": "shapley", "k3_before": start, "k3_after": end, "delta": p,
                         "share": p / total if total else float("nan")})
    return pd.DataFrame(rows, columns=ATTRIBUTION_COLUMNS)


def top_causes(table: pd.DataFrame, n: int = 3, order: str = "shapley") -> list[tuple[str, float]]:
    """The ``n`` causes with the largest share in ``order`` (shapley when present, else forward)."""
    d = table[table["order"] == order]
    if d.empty:
        d = table[table["order"] == "forward"]
    d = d.sort_values("share", ascending=False).head(n)
    return [(r.cause, float(r.share)) for r in d.itertuples()]
