"""GRPO advantages and clipped loss on hand-made numbers (exact expected values)."""
import math

import pytest
import torch

from minite.rl.grpo import group_advantages, grpo_loss, make_loss_fn, tis_weights, token_loss_sum


def test_group_advantages_std_normalised():
    # mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]), eps=0.0)
    torch.testing.assert_close(adv[0], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    s = math.sqrt(4 * 0.25 / 3)
    torch.testing.assert_close(adv[1], torch.tensor([0.5, 0.5, -0.5, -0.5]) / s)


def test_group_advantages_no_std_and_constant_group():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), std_normalize=False)
    torch.testing.assert_close(adv[0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.equal(adv[1], torch.zeros(4))          # all-equal group: no signal, no NaN
    assert torch.equal(group_advantages(torch.ones(1, 4)), torch.zeros(1, 4))


@pytest.mark.parametrize("bad", [torch.ones(4), torch.ones(2, 1), torch.tensor([[1.0, float("nan")]])])
def test_group_advantages_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        group_advantages(bad)


def _batch(adv, new, old):
    # tokens 0..3; response = tokens 2, 3 -> log-prob positions 1, 2 (of tokens 1..3)
    return (torch.tensor([[0.0, math.log(new[0]), math.log(new[1])]], requires_grad=True),
            {"loss_mask": torch.tensor([[0, 0, 1, 1]]), "advantages": torch.tensor([adv]),
             "old_logprobs": torch.tensor([[-7.0, math.log(old[0]), math.log(old[1])]])})


def test_clipped_loss_positive_advantage():
    lp, b = _batch(1.0, (0.5, 0.25), (0.4, 0.25))        # ratios 1.25 and 1.0
    loss = grpo_loss(lp, b, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)  # first token clipped at 1 + 0.2
    loss.backward()
    # clipped token: no gradient; unclipped: d/dlogp(-ratio * A) / n_tokens = -1 * 1.0 / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.5]]))


def test_clipped_loss_negative_advantage_and_clip_higher():
    lp, b = _batch(-1.0, (0.5, 0.25), (0.4, 0.25))
    # A < 0: min(-1.25, -1.2) = -1.25 -> no clipping on the upper side for negative advantages
    assert grpo_loss(lp, b, clip_low=0.2, clip_high=0.2).item() == pytest.approx((1.25 + 1.0) / 2)
    lp, b = _batch(1.0, (0.5, 0.25), (0.4, 0.25))
    # decoupled clip-higher 0.28 lets ratio 1.25 through
    assert grpo_loss(lp, b, clip_low=0.2, clip_high=0.28).item() == pytest.approx(-(1.25 + 1.0) / 2)
    lp, b = _batch(-1.0, (0.3, 0.25), (0.4, 0.25))        # ratio 0.75 < 1 - 0.2 with A < 0 -> clipped at 0.8
    assert grpo_loss(lp, b, clip_low=0.2, clip_high=0.28).item() == pytest.approx((0.8 + 1.0) / 2)


def test_masked_positions_ignored_even_if_garbage():
    lp, b = _batch(1.0, (0.5, 0.25), (0.5, 0.25))
    b["old_logprobs"][0, 0] = 1e4                          # would overflow exp() if not masked
    loss = grpo_loss(lp, b)
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0] == 0


def test_tis_weights_and_loss():
    old = torch.log(torch.tensor([[0.4, 0.2]]))
    samp = torch.log(torch.tensor([[0.2, 0.4]]))           # exp(old - samp) = 2.0, 0.5
    torch.testing.assert_close(tis_weights(old, samp, 1.5), torch.tensor([[1.5, 0.5]]))
    lp, b = _batch(1.0, (0.4, 0.2), (0.4, 0.2))            # ratios 1 -> per-token -A
    b["sampler_logprobs"] = torch.cat([torch.zeros(1, 1), samp], 1)
    assert grpo_loss(lp, b, tis_cap=1.5).item() == pytest.approx(-(1.5 + 0.5) / 2)
    assert grpo_loss(lp, b).item() == pytest.approx(-1.0)  # default: no IS correction at all
    with pytest.raises(ValueError):
        make_loss_fn(tis_cap=0.0)


def test_k3_kl_term():
    lp, b = _batch(0.0, (0.5, 0.25), (0.5, 0.25))          # A = 0: only the KL term remains
    b["ref_logprobs"] = torch.log(torch.tensor([[1.0, 0.25, 0.25]]))  # d = log(.25/.5) = -log 2, then 0
    d = -math.log(2.0)
    expected = 0.1 * (math.exp(d) - d - 1.0) / 2
    assert grpo_loss(lp, b, beta=0.1).item() == pytest.approx(expected)
    assert expected > 0


def test_aggregations_and_denominator():
    # two sequences: 1 response token with per-token loss -1, 3 response tokens with per-token loss -1 * 3 (A=3)
    lp = torch.zeros(2, 3, requires_grad=True)
    b = {"loss_mask": torch.tensor([[0, 0, 0, 1], [0, 1, 1, 1]]), "advantages": torch.tensor([1.0, 3.0]),
         "old_logprobs": torch.zeros(2, 3)}
    assert grpo_loss(lp, b).item() == pytest.approx(-(1 + 9) / 4)              # token-mean (DAPO)
    assert grpo_loss(lp, b, agg="seq-mean-token-mean").item() == pytest.approx(-(1 + 3) / 2)
    # micro-batching (the trainer's contract): each half's sum with the whole batch's counts, over the whole
    # batch's loss tokens, sums to the full-batch objective, for both aggregations
    counts = {"_n_tokens": 4, "_n_sequences": 2}
    halves = [{**{k: v[i:i + 1] for k, v in b.items()}, **counts} for i in (0, 1)]
    total = sum(token_loss_sum(lp[i:i + 1], h).item() for i, h in enumerate(halves)) / 4
    assert total == pytest.approx(-(1 + 9) / 4)
    total = sum(token_loss_sum(lp[i:i + 1], h, agg="seq-mean-token-mean").item() for i, h in enumerate(halves)) / 4
    assert total == pytest.approx(-(1 + 3) / 2)
    with pytest.raises(ValueError):
        grpo_loss(lp, b, agg="sum")


def test_tis_weight_scales_each_token_gradient_and_carries_none():
    """Token-level TIS (Yao et al. 2025; verl rollout_is token/truncate): each response token's policy-gradient
    term is multiplied by w = min(exp(logp_old - logp_sampler), cap), a constant: d loss / d logp_t is w_t times
    the uncorrected gradient, and no gradient reaches the log-probs w is computed from."""
    lp, b = _batch(1.0, (0.5, 0.25), (0.5, 0.25))          # ratios 1, inside the clip range
    plain = grpo_loss(lp, b, clip_low=0.2, clip_high=0.2)
    plain.backward()
    g_plain = lp.grad.clone()
    lp.grad = None
    old = b["old_logprobs"].clone().requires_grad_(True)
    samp = torch.log(torch.tensor([[0.5, 0.1, 0.5]])).requires_grad_(True)   # w = min(5, 2) = 2, 0.5
    corrected = grpo_loss(lp, {**b, "old_logprobs": old, "sampler_logprobs": samp}, clip_low=0.2, clip_high=0.2,
                          tis_cap=2.0)
    corrected.backward()
    torch.testing.assert_close(lp.grad, g_plain * torch.tensor([[0.0, 2.0, 0.5]]))
    assert samp.grad is None or not samp.grad.any()         # stop-gradient through the weights
    assert corrected.item() == pytest.approx(-(2.0 + 0.5) / 2)
