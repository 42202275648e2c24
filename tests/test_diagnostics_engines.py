"""Diagnostics on the real engines (tiny, CPU): the arms' mismatch ordering, exact alignment, an injected
fault localised to its layer, and attribution steps that sum to the total."""
import dataclasses

import pytest
import torch

from minite import nvfp4
from minite.diagnostics import attribution as A
from minite.diagnostics.localise import ROUNDING_THRESHOLD, attention_mask_for, localise
from minite.diagnostics.metrics import align_trainer_logprobs, mismatch_metrics
from minite.diagnostics.run import measure, sample
from minite.engines import build_engines
from minite.engines.arms import load_arm
from minite.engines.models import load_model_config
from minite.tasks import task_for_model

N_PROMPTS, NEW = 6, 6


@pytest.fixture(scope="module")
def cfg():
    return load_model_config("tiny")


@pytest.fixture(scope="module")
def prompts(cfg):
    return task_for_model(None, cfg, seed=0).heldout_prompts(N_PROMPTS)


def _pair(arm, cfg, prompts):
    return build_engines(arm, cfg, seed=0, calibration_prompts=prompts, max_batch=len(prompts),
                      max_seq_len=max(map(len, prompts)) + NEW + 1)


@pytest.fixture(scope="module")
def runs(cfg, prompts):
    """arm -> (trainer, sampler, generation, metrics of the sampler's own generation log-probs, the
    sampler's decode-path replay of those tokens)."""
    out = {}
    for name in ("bf16", "naive_te_nvfp4", "minite_nvfp4"):
        tr, sa = _pair(load_arm(name), cfg, prompts)
        gen = sample(sa, prompts, NEW, seed=0)
        att = attention_mask_for(gen.tokens, gen.prompt_lens, gen.response_mask)
        logp_t = align_trainer_logprobs(tr.logprobs(gen.tokens, att))
        out[name] = (tr, sa, gen, mismatch_metrics(gen.logprobs, logp_t, gen.response_mask),
                     sa.score(gen.tokens, gen.prompt_lens))
    return out


def test_naive_mismatch_is_10x_bf16(runs):
    k3 = {a: r[3]["k3"] for a, r in runs.items()}
    assert k3["bf16"] > 0  # two different BF16 engines do differ
    assert k3["naive_te_nvfp4"] >= 10 * k3["bf16"], k3


def test_aligned_is_exact(runs):
    k3 = {a: r[3]["k3"] for a, r in runs.items()}
    m = runs["minite_nvfp4"][3]
    assert k3["minite_nvfp4"] <= k3["bf16"], k3
    assert m["k3"] == 0.0 and m["max_abs_dlogp"] == 0.0 and m["token_mult_prob_error"] == 1.0


def test_decode_replay_matches_generation(runs):
    for name, (_, _, gen, _, s) in runs.items():
        mask = gen.response_mask.bool()
        assert torch.equal(s[mask], gen.logprobs[mask]), name


def _scaled(t: nvfp4.NVFP4Tensor, f: float) -> nvfp4.NVFP4Tensor:
    return dataclasses.replace(t, global_scale=t.global_scale * f)


def test_injected_fault_localised_on_real_engines(runs):
    tr, sa, gen, _, _ = runs["minite_nvfp4"]
    clean = localise(tr, sa, gen.tokens, gen.prompt_lens, gen.response_mask)
    assert clean["first_divergence"] is None
    assert (clean["table"].query("metric == 'rel_err'")["value"] == 0).all()
    payload = tr.export_weights()
    name = "model.layers.1.self_attn.o_proj.weight"
    payload["tensors"][name] = _scaled(payload["tensors"][name], 1.25)  # sampler-only fault in layer 1
    sa.load_weights(payload)
    try:
        r = localise(tr, sa, gen.tokens, gen.prompt_lens, gen.response_mask)
    finally:
        sa.load_weights(tr.export_weights())
    assert r["first_divergence"]["layer"] == 1 and r["first_divergence"]["op"] == "attn_out"
    t = r["table"].query("metric == 'rel_err'")
    assert (t[t.layer == 0]["value"] == 0).all()
    assert (t[t.layer >= 1]["value"] > ROUNDING_THRESHOLD).all()


@pytest.mark.slow
def test_attribution_steps_sum_on_engines(cfg, prompts, runs):
    """Two causes (4 arms) on fixed tokens from the naive sampler: every order sums to the total."""
    gen = runs["naive_te_nvfp4"][2]
    causes = ("weights", "activations")

    def v(s):
        tr, sa = _pair(A.subset_arm(s), cfg, prompts)
        return measure(tr, sa, gen.tokens, gen.prompt_lens, gen.response_mask)["k3"]
    t = A.attribute(v, causes=causes)
    total = float(t[t.order == "forward"]["k3_before"].iloc[0] - t[t.order == "forward"]["k3_after"].iloc[-1])
    for order in ("forward", "reverse", "shapley"):
        assert t[t.order == order]["delta"].sum() == pytest.approx(total, rel=1e-9, abs=1e-15)
    assert total > 0  # these two causes reduce the naive mismatch
