"""Attribution bookkeeping: every cause subset is a valid arm, the full set is minite_nvfp4, and each
order's steps sum to the total gap (on synthetic metric functions: no engines needed). The five-cause
bookkeeping runs from the blanket variant (its trainer quantizes the router: every cause is a difference);
the default naive arm (Megatron-core deployment, BF16 router) has four."""
import itertools

import pytest

from minite.diagnostics.attribution import (
    CAUSES,
    active_causes,
    all_causes_arm,
    attribute,
    same_recipe,
    shapley_values,
    subset_arm,
    top_causes,
)
from minite.engines.arms import load_arm

BLANKET = load_arm("naive_te_nvfp4_blanket")


def test_every_subset_is_a_valid_arm_and_ends_at_minite():
    seen = set()
    for r in range(len(CAUSES) + 1):
        for s in itertools.combinations(CAUSES, r):
            arm = subset_arm(frozenset(s), BLANKET)
            seen.add((arm.sync, arm.trainer, arm.sampler))
    assert len(seen) == 32  # every cause changes something, in every context
    assert same_recipe(all_causes_arm(BLANKET), load_arm("minite_nvfp4"))
    assert same_recipe(subset_arm(frozenset(), BLANKET), BLANKET)


def test_weights_cause_uses_code_sync_only_with_equal_high_precision():
    a = subset_arm(frozenset({"weights"}), BLANKET)
    assert a.sync == "bf16" and a.sampler.weights == a.trainer.weights  # trainer's quantizer, re-applied
    b = subset_arm(frozenset({"weights", "high_precision"}), BLANKET)
    assert b.sync == "nvfp4_codes" and b.sampler.weights == "from_trainer"


def test_megatron_naive_arm_has_no_high_precision_cause():
    """The default naive arm keeps the router BF16 in both engines: its gap has four causes (16 arms), the
    weights cause alone is real code sync, and the four still end exactly at minite_nvfp4."""
    naive = load_arm("naive_te_nvfp4")
    assert active_causes(naive) == ("weights", "activations", "gemm", "non_gemm")
    assert active_causes(BLANKET) == CAUSES
    assert same_recipe(subset_arm(frozenset({"high_precision"}), naive), naive)
    a = subset_arm(frozenset({"weights"}), naive)
    assert a.sync == "nvfp4_codes" and a.sampler.weights == "from_trainer"
    assert same_recipe(all_causes_arm(naive), load_arm("minite_nvfp4"))
    seen = {(x.sync, x.trainer, x.sampler) for r in range(5)
            for s in itertools.combinations(active_causes(naive), r) for x in [subset_arm(frozenset(s), naive)]}
    assert len(seen) == 16


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
