"""Attribution bookkeeping: every cause subset is a valid arm, the full set is minite_nvfp4, and each
order's steps sum to the total gap (on synthetic metric functions: no engines needed)."""
import itertools

import pytest

from minite.diagnostics.attribution import (
    CAUSES,
    all_causes_arm,
    attribute,
    same_recipe,
    shapley_values,
    subset_arm,
    top_causes,
)
from minite.engines.arms import load_arm


def test_every_subset_is_a_valid_arm_and_ends_at_minite():
    seen = set()
    for r in range(len(CAUSES) + 1):
        for s in itertools.combinations(CAUSES, r):
            arm = subset_arm(frozenset(s))
            seen.add((arm.sync, arm.trainer, arm.sampler))
    assert len(seen) == 32  # every cause changes something, in every context
    assert same_recipe(all_causes_arm(), load_arm("minite_nvfp4"))
    assert same_recipe(subset_arm(frozenset()), load_arm("naive_te_nvfp4"))


def test_weights_cause_uses_code_sync_only_with_equal_high_precision():
    a = subset_arm(frozenset({"weights"}))
    assert a.sync == "bf16" and a.sampler.weights == a.trainer.weights  # trainer's quantizer, re-applied
    b = subset_arm(frozenset({"weights", "high_precision"}))
    assert b.sync == "nvfp4_codes" and b.sampler.weights == "from_trainer"


def _check_sums(table, total):
    for order in ("forward", "reverse", "shapley"):
        d = table[table["order"] == order]
        assert len(d) == len(CAUSES)
        assert d["delta"].sum() == pytest.approx(total, rel=1e-12, abs=1e-15)
        assert d["share"].sum() == pytest.approx(1.0, rel=1e-12)


def test_additive_metric_every_order_agrees():
    contrib = dict(zip(CAUSES, (0.5, 0.2, 0.1, 0.05, 0.15), strict=True))
    v = lambda s: 1.0 - sum(contrib[c] for c in s)  # noqa: E731
    t = attribute(v)
    _check_sums(t, 1.0)
    for order in ("forward", "reverse", "shapley"):
        got = dict(zip(t[t.order == order].cause, t[t.order == order].delta, strict=True))
        assert got == pytest.approx(contrib)
    assert [c for c, _ in top_causes(t)] == ["weights", "activations", "non_gemm"]


def test_interacting_metric_orders_differ_but_sum():
    # weights only helps once activations are fixed; gemm makes things worse alone.
    def v(s):
        x = 2.0
        if "activations" in s:
            x -= 0.5
            if "weights" in s:
                x -= 1.0
        if "gemm" in s:
            x += 0.1 if "non_gemm" not in s else -0.2
        return x - (0.05 if "high_precision" in s else 0.0)
    t = attribute(v)
    total = v(frozenset()) - v(frozenset(CAUSES))
    _check_sums(t, total)
    fwd = dict(zip(t[t.order == "forward"].cause, t[t.order == "forward"].delta, strict=True))
    rev = dict(zip(t[t.order == "reverse"].cause, t[t.order == "reverse"].delta, strict=True))
    assert fwd["weights"] == pytest.approx(0.0) and rev["weights"] == pytest.approx(1.0)
    phi = shapley_values(v)
    assert phi["weights"] == pytest.approx(0.5) and phi["activations"] == pytest.approx(1.0)


def test_measure_called_once_per_subset():
    calls = []
    attribute(lambda s: calls.append(s) or float(len(s)))
    assert len(calls) == 32 and len(set(calls)) == 32


def test_unknown_cause_rejected():
    with pytest.raises(ValueError, match="unknown causes"):
        subset_arm(frozenset({"bogus"}))
