"""Token-level trainer/sampler mismatch: the numbers RL frameworks log, computed one way, in float64.

Inputs: ``logp_s`` (the sampler's log-prob of each sampled token, what it sampled from), ``logp_t`` (the
trainer's teacher-forced log-prob of the same token, same weights) and a response ``mask`` (1 on the tokens
that are scored), all [B, T] and aligned on token positions. With r = logp_t - logp_s (the per-token log
importance ratio log pi_train / pi_rollout), means are over all masked tokens of the batch (token-mean):

    k1                    mean(logp_s - logp_t)             = -mean(r). Direct estimator of KL(pi_s || pi_t).
                          verl ``rollout_corr/kl`` (verl/trainer/ppo/rollout_corr_helper.py,
                          ``compute_offpolicy_metrics``: masked_mean(rollout_log_prob - old_log_prob)).
    k3                    mean(exp(r) - r - 1) >= 0. Schulman's k3 estimator of the same KL, unbiased and
                          never negative. verl ``rollout_corr/k3_kl`` (same function).
    chi2                  mean(exp(2 r)) - 1: token-level chi^2(pi_t || pi_s), the variance of the IS weight.
                          verl ``rollout_corr/chi2_token`` (r clamped to +-20 as verl's SAFETY_BOUND does).
    chi2_seq              mean_b(exp(2 sum_t r)) - 1, verl ``rollout_corr/chi2_seq`` (sum clamped to +-20).
    token_mult_prob_error mean(exp(|logp_t - logp_s|)) >= 1. NeMo-RL ``token_mult_prob_error``
                          (nemo_rl/algorithms/loss_functions.py, ClippedPGLossFn: masked_mean(exp(|gen - prev|)));
                          1.0 means identical engines.
    mean_abs_dlogp, max_abs_dlogp
                          mean / max |logp_t - logp_s|: TRL GRPOTrainer ``sampling/sampling_logp_difference/
                          {mean,max}`` (trl/trainer/grpo_trainer.py, vLLM importance-sampling correction).
    mean_abs_dp, max_abs_dp, std_abs_dp
                          |p_t - p_s| with p = exp(logp): verl ``training/rollout_probs_diff_{mean,max,std}``
                          (verl/utils/debug/metrics.py, ``calculate_debug_metrics``).
    pearson_p             Pearson correlation of p_t and p_s over masked tokens: verl
                          ``training/rollout_actor_probs_pearson_corr``. Defined as 1.0 when both vectors are
                          identical (also when constant) and None (JSON null) when one is constant and they differ.
    frac_dlogp_gt_0.1     fraction of tokens with |logp_t - logp_s| > 0.1 (a ~10% probability error).
    sequence level        per sequence R_b = sum_t r (the log sequence IS weight): seq_mean_abs_log_ratio and
                          seq_max_abs_log_ratio = mean_b / max_b |R_b|; verl's log_ppl_diff family
                          (mean_t logp_s - mean_t logp_t per sequence: log_ppl_diff, log_ppl_abs_diff,
                          log_ppl_diff_max, log_ppl_diff_min) and the two engines' log-perplexities
                          (training_log_ppl, rollout_log_ppl: mean over sequences of -mean_t logp).

Errors: mismatched shapes, an empty mask, or a NaN/Inf log-prob on a masked token raise ``ValueError``
(a non-finite log-prob would silently poison every mean).

``DEFINITIONS`` says the same per metric in a form a result can carry: formula, which way is better, units,
thresholds and source. ``mismatch.json`` embeds it (``definitions``) and the report shows it, so a reader of
either never has to come back here.
"""
from __future__ import annotations

import math

import torch

from minite.diagnostics.localise import ROUNDING_THRESHOLD

#: verl's clamp on log ratios before exponentiating (rollout_corr_helper.SAFETY_BOUND).
SAFETY_BOUND = 20.0
#: |dlogp| threshold for ``frac_dlogp_gt_0.1``.
DLOGP_THRESHOLD = 0.1
#: The keys every mismatch.json carries (the issue's contract); the rest are extras.
CORE_KEYS = ("k1", "k3", "chi2", "token_mult_prob_error", "max_abs_dp", "mean_abs_dp", "pearson_p",
             "frac_dlogp_gt_0.1", "n_tokens")

_R = "r = logp_t - logp_s per scored token (trainer minus sampler log-prob); means over all scored tokens"
_LOWER0, _NATS = "lower; 0 = identical engines", "nats per token"


def _d(formula, better, units, source=None, **extra) -> dict:
    return {"formula": formula, "better": better, "units": units, **({"source": source} if source else {}), **extra}


#: Every metric of mismatch.json: formula, which way is better, units, thresholds, source.
DEFINITIONS = {
    "n_tokens": _d("number of scored (response) tokens", "more = a tighter estimate", "tokens"),
    "n_sequences": _d("number of sequences with a scored token", "more = a tighter estimate", "sequences"),
    "k1": _d(f"mean(-r); {_R}", "closer to 0 (an unbiased estimate of KL(sampler || trainer); a sample can "
             "make it negative)", _NATS, "verl rollout_corr/kl"),
    "k3": _d("mean(exp(r) - r - 1) >= 0", _LOWER0, _NATS, "verl rollout_corr/k3_kl (Schulman's k3 estimator of "
             "KL(sampler || trainer))"),
    "chi2": _d(f"mean(exp(2 clamp(r, +-{SAFETY_BOUND:g}))) - 1", "closer to 0 (the variance of the per-token "
               "importance weight; a sample can make it slightly negative)", "dimensionless",
               "verl rollout_corr/chi2_token"),
    "chi2_seq": _d(f"mean_b(exp(2 clamp(R_b, +-{SAFETY_BOUND:g}))) - 1, R_b = sum of r over sequence b",
                   "closer to 0", "dimensionless", "verl rollout_corr/chi2_seq"),
    "token_mult_prob_error": _d("mean(exp(|r|)) >= 1", "lower; 1 = identical engines", "multiplicative "
                                "probability error (ratio)", "NeMo-RL token_mult_prob_error"),
    "mean_abs_dlogp": _d("mean(|r|)", _LOWER0, _NATS, "TRL sampling/sampling_logp_difference/mean"),
    "max_abs_dlogp": _d("max(|r|)", _LOWER0, _NATS, "TRL sampling/sampling_logp_difference/max"),
    "mean_abs_dp": _d("mean(|p_t - p_s|), p = exp(logp)", _LOWER0, "probability",
                      "verl training/rollout_probs_diff_mean"),
    "max_abs_dp": _d("max(|p_t - p_s|)", _LOWER0, "probability", "verl training/rollout_probs_diff_max"),
    "std_abs_dp": _d("std(|p_t - p_s|)", _LOWER0, "probability", "verl training/rollout_probs_diff_std"),
    "pearson_p": _d("Pearson correlation of p_t and p_s (1.0 when identical; null when one side is constant "
                    "and they differ)", "higher; 1 = identical engines", "dimensionless",
                    "verl training/rollout_actor_probs_pearson_corr"),
    f"frac_dlogp_gt_{DLOGP_THRESHOLD}": _d(f"fraction of tokens with |r| > {DLOGP_THRESHOLD}", _LOWER0,
                                           "fraction of tokens", threshold=DLOGP_THRESHOLD,
                                           threshold_meaning="|r| = 0.1 is a ~10% probability error"),
    "seq_mean_abs_log_ratio": _d("mean_b |R_b|", _LOWER0, "nats per sequence"),
    "seq_max_abs_log_ratio": _d("max_b |R_b|", _LOWER0, "nats per sequence"),
    "log_ppl_diff": _d("mean_b d_b, d_b = mean_t logp_s - mean_t logp_t over sequence b", "closer to 0",
                       _NATS, "verl log_ppl_diff"),
    "log_ppl_abs_diff": _d("mean_b |d_b|", _LOWER0, _NATS, "verl log_ppl_abs_diff"),
    "log_ppl_diff_max": _d("max_b d_b", "closer to 0", _NATS, "verl log_ppl_diff_max"),
    "log_ppl_diff_min": _d("min_b d_b", "closer to 0", _NATS, "verl log_ppl_diff_min"),
    "training_log_ppl": _d("mean_b(-mean_t logp_t)", "context, not a mismatch (equals rollout_log_ppl when the "
                           "engines agree)", _NATS),
    "rollout_log_ppl": _d("mean_b(-mean_t logp_s)", "context, not a mismatch", _NATS),
    "first_divergence": _d("the first (layer, op), in execution order, whose relative error "
                           "||a_s - a_t||_F / ||a_t||_F (sampler vs trainer activations) exceeds the threshold; "
                           "null when none does", "later or null", "layer and op",
                           "minite.diagnostics.localise", threshold=ROUNDING_THRESHOLD,
                           threshold_meaning="2**-7 = twice BF16's unit roundoff: engines that only round "
                           "differently stay below it, NVFP4 quantization (errors ~2**-3..2**-4) lands far "
                           "above"),
    "score_replay_max_abs_diff": _d("max |sampler's generation log-prob - its decode-path replay|",
                                    "0 (the replay the localisation uses reproduces generation exactly)", _NATS),
}

#: Why the attribution's k3 is not mismatch.json's k3 (both are written; they must not be compared).
ATTRIBUTION_NOTE = ("attribution.csv's k3 values are measured on other tokens than mismatch.json's k3: the "
                    "attribution scores the tokens the naive arm's sampler generated for its own prompt count "
                    "(attribution_settings.prompts), every cause subset on exactly those tokens; mismatch.json "
                    "scores the arm's own sampler's tokens for settings.prompts prompts. Compare k3 within "
                    "one file, not across them.")


def _as_f64(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2:
        raise ValueError(f"{name}: expected [B, T] (or [T]), got shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.float64)


def align_trainer_logprobs(logp_t: torch.Tensor) -> torch.Tensor:
    """Trainer log-probs [B, T-1] (of tokens 1..T-1) -> [B, T] on token positions (0 at position 0),
    the layout of the sampler's ``out.logprobs``."""
    return torch.nn.functional.pad(torch.as_tensor(logp_t), (1, 0))


def mismatch_metrics(logp_s, logp_t, mask) -> dict:
    """All token- and sequence-level mismatch statistics (see module docstring) as plain floats."""
    ls, lt = _as_f64(logp_s, "logp_s"), _as_f64(logp_t, "logp_t")
    m = _as_f64(mask, "mask") != 0
    if ls.shape != lt.shape or ls.shape != m.shape:
        raise ValueError(f"shape mismatch: logp_s {tuple(ls.shape)}, logp_t {tuple(lt.shape)}, "
                         f"mask {tuple(m.shape)}")
    n = int(m.sum())
    if n == 0:
        raise ValueError("the response mask selects no token")
    for name, t in (("logp_s", ls), ("logp_t", lt)):
        bad = ~torch.isfinite(t) & m
        if bad.any():
            b, pos = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{name} is not finite at a masked token (sequence {b}, position {pos}): "
                             f"{t[b, pos].item()}")
    if (ls[m] > 1e-9).any() or (lt[m] > 1e-9).any():
        raise ValueError("log-probs must be <= 0 (got a positive value: are these logits?)")

    r = (lt - ls)[m]                       # log pi_t / pi_s on masked tokens, flattened
    abs_r = r.abs()
    p_t, p_s = lt[m].exp(), ls[m].exp()
    abs_dp = (p_t - p_s).abs()
    rc = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)

    out = {
        "n_tokens": n,
        "n_sequences": int(m.any(dim=1).sum()),
        "k1": float((-r).mean()),
        # expm1(r) - r, not exp(r) - r - 1: at |r| below an ulp of 1 the latter rounds to -2^-54, where
        # expm1(r) >= r holds in floats too (r is exact and rounding is monotone), so every term is >= 0
        "k3": float((torch.expm1(r) - r).mean()),
        "chi2": float((2 * rc).exp().mean() - 1),
        "token_mult_prob_error": float(abs_r.exp().mean()),
        "mean_abs_dlogp": float(abs_r.mean()),
        "max_abs_dlogp": float(abs_r.max()),
        "max_abs_dp": float(abs_dp.max()),
        "mean_abs_dp": float(abs_dp.mean()),
        "std_abs_dp": float(abs_dp.std()) if n > 1 else 0.0,
        "pearson_p": _pearson(p_t, p_s),
        f"frac_dlogp_gt_{DLOGP_THRESHOLD}": float((abs_r > DLOGP_THRESHOLD).double().mean()),
    }
    out.update(_sequence_stats(ls, lt, m))
    return out


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if torch.equal(a, b):
        return 1.0
    da, db = a - a.mean(), b - b.mean()
    den = math.sqrt(float((da * da).sum()) * float((db * db).sum()))
    if den == 0.0:
        return None                         # one side constant, the other not: undefined
    return float((da * db).sum()) / den


def _sequence_stats(ls: torch.Tensor, lt: torch.Tensor, m: torch.Tensor) -> dict:
    rows = m.any(dim=1)
    ls, lt = ls.where(m, 0.0)[rows], lt.where(m, 0.0)[rows]   # masked slots may hold NaN padding
    mf = m[rows].double()
    cnt = mf.sum(1)
    seq_r = ((lt - ls) * mf).sum(1)                          # log sequence IS weight per sequence
    mean_s, mean_t = (ls * mf).sum(1) / cnt, (lt * mf).sum(1) / cnt
    log_ppl_diff = mean_s - mean_t                           # verl: log(training_ppl / rollout_ppl)
    seq_rc = seq_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "seq_mean_abs_log_ratio": float(seq_r.abs().mean()),
        "seq_max_abs_log_ratio": float(seq_r.abs().max()),
        "chi2_seq": float((2 * seq_rc).exp().mean() - 1),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "training_log_ppl": float((-mean_t).mean()),
        "rollout_log_ppl": float((-mean_s).mean()),
    }
