"""Mismatch metric definitions on hand-made log-prob pairs (expected values computed by hand)."""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minite.diagnostics.metrics import CORE_KEYS, align_trainer_logprobs, mismatch_metrics

L2 = math.log(2.0)
NAN = float("nan")


def _pair():
    # Two sequences; masked positions hold garbage (NaN) that must be ignored.
    f64 = torch.float64
    ls = torch.tensor([[math.log(0.5), math.log(0.25), NAN], [math.log(0.8), NAN, 0.0]], dtype=f64)
    lt = torch.tensor([[math.log(0.25), math.log(0.25), NAN], [math.log(0.4), 3.0, NAN]], dtype=f64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return ls, lt, mask


def test_hand_computed_values():
    m = mismatch_metrics(*_pair())
    # r = logp_t - logp_s = [-ln2, 0, -ln2]; p_t = [.25, .25, .4]; p_s = [.5, .25, .8]
    assert m["n_tokens"] == 3 and m["n_sequences"] == 2
    assert m["k1"] == pytest.approx(2 * L2 / 3, rel=1e-12)
    assert m["k3"] == pytest.approx(2 * (0.5 + L2 - 1) / 3, rel=1e-12)
    assert m["chi2"] == pytest.approx((0.25 + 1 + 0.25) / 3 - 1, rel=1e-12)
    assert m["token_mult_prob_error"] == pytest.approx((2 + 1 + 2) / 3, rel=1e-12)
    assert m["max_abs_dp"] == pytest.approx(0.4, rel=1e-12)
    assert m["mean_abs_dp"] == pytest.approx(0.65 / 3, rel=1e-12)
    assert m["mean_abs_dlogp"] == pytest.approx(2 * L2 / 3, rel=1e-12)
    assert m["max_abs_dlogp"] == pytest.approx(L2, rel=1e-12)
    # centred p_t = [-1, -1, 2]/20, centred p_s = [-1, -16, 17]/60 -> 51 / sqrt(6 * 546)
    assert m["pearson_p"] == pytest.approx(51 / math.sqrt(6 * 546), rel=1e-12)
    assert m["frac_dlogp_gt_0.1"] == pytest.approx(2 / 3, rel=1e-12)
    # sequence level: sum r = -ln2 for both sequences
    assert m["seq_mean_abs_log_ratio"] == pytest.approx(L2, rel=1e-12)
    assert m["seq_max_abs_log_ratio"] == pytest.approx(L2, rel=1e-12)
    assert m["chi2_seq"] == pytest.approx(0.25 - 1, rel=1e-12)
    # log_ppl_diff per sequence: (-1.5 ln2) - (-2 ln2) = .5 ln2 and ln(.8) - ln(.4) = ln2
    assert m["log_ppl_diff"] == pytest.approx(0.75 * L2, rel=1e-12)
    assert m["log_ppl_diff_max"] == pytest.approx(L2, rel=1e-12)
    assert m["log_ppl_diff_min"] == pytest.approx(0.5 * L2, rel=1e-12)
    assert m["training_log_ppl"] == pytest.approx((2 * L2 - math.log(0.4)) / 2, rel=1e-12)
    assert m["rollout_log_ppl"] == pytest.approx((1.5 * L2 - math.log(0.8)) / 2, rel=1e-12)
    assert set(CORE_KEYS) <= set(m)


def test_identical_engines_give_exact_zero():
    ls = torch.log(torch.tensor([[0.3, 0.9, 0.5], [0.1, 0.2, 0.7]]))
    m = mismatch_metrics(ls, ls.clone(), torch.ones(2, 3))
    assert m["k1"] == 0.0 and m["k3"] == 0.0 and m["chi2"] == 0.0
    assert m["token_mult_prob_error"] == 1.0 and m["max_abs_dp"] == 0.0
    assert m["pearson_p"] == 1.0 and m["frac_dlogp_gt_0.1"] == 0.0 and m["chi2_seq"] == 0.0


def test_float64_keeps_tiny_differences():
    # 1e-7 apart in fp32 inputs: k3 ~ r^2/2 ~ 5e-15 must not round to 0 or go negative.
    ls = torch.full((1, 4), -1.0, dtype=torch.float32)
    lt = ls + 1e-7
    m = mismatch_metrics(ls, lt, torch.ones(1, 4))
    r = float(lt[0, 0].double() - ls[0, 0].double())
    assert m["k3"] == pytest.approx(r * r / 2, rel=1e-3)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-8, 0), st.floats(-8, 0)), min_size=2, max_size=40))
@example([(0.0, -2.0)] * 7)   # seven equal |dp|: their float mean rounds one ulp above their max
@example([(0.0, 0.0), (-6.330550163202273e-17, 0.0)])  # exp(r) - r - 1 rounds below 0 at r under an ulp of 1
def test_k3_nonnegative_and_bounds(pairs):
    ls = torch.tensor([[a for a, _ in pairs]], dtype=torch.float64)
    lt = torch.tensor([[b for _, b in pairs]], dtype=torch.float64)
    m = mismatch_metrics(ls, lt, torch.ones_like(ls))
    assert m["k3"] >= 0.0
    assert m["token_mult_prob_error"] >= 1.0
    assert 0.0 <= m["frac_dlogp_gt_0.1"] <= 1.0
    assert m["mean_abs_dp"] >= 0.0 and m["mean_abs_dp"] <= m["max_abs_dp"] * (1 + 1e-15)  # a mean rounds
    # k1 == -mean(r) and |k1| <= mean|r|
    assert abs(m["k1"]) <= m["mean_abs_dlogp"] + 1e-12


def test_bad_inputs_raise():
    ls, lt, mask = _pair()
    with pytest.raises(ValueError, match="no token"):
        mismatch_metrics(ls, lt, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shape"):
        mismatch_metrics(ls[:, :2], lt, mask)
    bad = lt.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        mismatch_metrics(ls, bad, mask)
    with pytest.raises(ValueError, match="<= 0"):
        mismatch_metrics(ls.abs().nan_to_num(), lt, mask)


def test_align_trainer_logprobs():
    t = torch.tensor([[-1.0, -2.0]])
    assert align_trainer_logprobs(t).tolist() == [[0.0, -1.0, -2.0]]


def test_every_metric_has_a_definition():
    """mismatch.json embeds DEFINITIONS: every metric it writes is defined (formula, direction, units)."""
    from minite.diagnostics.localise import ROUNDING_THRESHOLD
    from minite.diagnostics.metrics import DEFINITIONS
    m = mismatch_metrics(*_pair())
    assert set(m) <= set(DEFINITIONS)
    for key in [*m, "first_divergence"]:
        assert {"formula", "better", "units"} <= set(DEFINITIONS[key]), key
    assert DEFINITIONS["first_divergence"]["threshold"] == ROUNDING_THRESHOLD == 0.0078125
    assert DEFINITIONS["frac_dlogp_gt_0.1"]["threshold"] == 0.1
    assert "lower" in DEFINITIONS["k3"]["better"] and "higher" in DEFINITIONS["pearson_p"]["better"]
