"""Localisation on a self-contained engine pair built from upstream transformers (no minite engines):
the 'trainer' scores whole sequences, the 'sampler' replays them one decode step at a time through HF's KV
cache and reports each op through the capture protocol of docs/ENGINES.md. An injected fault (one layer's
weights perturbed in the sampler only) must be named as the first divergence, at that layer."""
import copy

import pandas as pd
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from minite.diagnostics.localise import (
    ROUNDING_THRESHOLD,
    SamplerCapture,
    compare,
    compare_positions,
    first_divergence,
    localise,
)


def _model(seed=0):
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, intermediate_size=64, max_position_embeddings=64,
                         decoder_sparse_step=1, mlp_only_layers=[], attn_implementation="eager")
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits the router: give it weights so top-k is meaningful
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return m


class FakeTrainer:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def logprobs(self, input_ids, attention_mask=None):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


class FakeSampler:
    """Decode-path replay with capture(layer, op, position, tensor) (equal prompt lengths)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def score(self, tokens, prompt_lens, capture=None):
        P = int(prompt_lens[0])
        assert all(int(p) == P for p in prompt_lens)
        m, B, T = self.model, tokens.shape[0], tokens.shape[1]
        state = {"pos": None}
        hooks = []

        def emit(layer, op):
            def hook(_m, _i, out):
                if capture is None or state["pos"] is None:
                    return
                if op == "router":
                    logits, _, idx = out
                    capture(layer, "router_logits", state["pos"], logits.reshape(B, 1, -1))
                    capture(layer, "topk", state["pos"], idx.reshape(B, 1, -1))
                    return
                capture(layer, op, state["pos"], (out[0] if isinstance(out, tuple) else out))
            return hook

        for i, layer in enumerate(m.model.layers):
            hooks += [layer.self_attn.register_forward_hook(emit(i, "attn_out")),
                      layer.mlp.gate.register_forward_hook(emit(i, "router")),
                      layer.mlp.register_forward_hook(emit(i, "moe_out")),
                      layer.register_forward_hook(emit(i, "residual"))]
        hooks.append(m.lm_head.register_forward_hook(emit(None, "logits")))
        out = torch.zeros(B, T)
        try:
            res = m(input_ids=tokens[:, : P - 1], use_cache=True)  # prefill all but the last prompt token
            cache = res.cache
            for q in range(P - 1, T - 1):                         # one decode step per position
                state["pos"] = q
                res = m(input_ids=tokens[:, q: q + 1], cache=cache, use_cache=True)
                cache = res.cache
                lp = torch.log_softmax(res.logits[:, -1].float(), -1)
                out[:, q + 1] = lp.gather(-1, tokens[:, q + 1: q + 2])[:, 0]
        finally:
            for h in hooks:
                h.remove()
        return out


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 32, (2, 9), generator=g)
    plens = torch.tensor([4, 4])
    resp = torch.zeros_like(tokens)
    resp[:, 4:] = 1
    return tokens, plens, resp


def test_identical_pair_is_within_rounding():
    m = _model()
    tokens, plens, resp = _batch()
    r = localise(FakeTrainer(m), FakeSampler(copy.deepcopy(m)), tokens, plens, resp)
    t = r["table"]
    assert r["first_divergence"] is None
    assert set(t["op"]) == {"attn_out", "router_logits", "topk", "moe_out", "residual", "logits"}
    assert (t[t.metric == "rel_err"]["value"] < 1e-4).all()
    assert (t[t.metric == "topk_disagree"]["value"] == 0).all()
    assert (t[t.metric == "n_positions"]["value"] == 2 * 5).all()   # positions 3..7 of 2 sequences
    assert r["captured"]["missing_in_sampler"] == []
    # the two log-prob paths agree too
    lp_t = torch.nn.functional.pad(r["logp_t"], (1, 0))
    assert torch.allclose(lp_t[resp == 1], r["logp_s"][resp == 1], atol=1e-4)


def test_injected_fault_is_localised(fault_layer=1):
    m = _model()
    bad = copy.deepcopy(m)
    with torch.no_grad():
        bad.model.layers[fault_layer].self_attn.o_proj.weight.mul_(1.3)
    tokens, plens, resp = _batch()
    r = localise(FakeTrainer(m), FakeSampler(bad), tokens, plens, resp)
    fd = r["first_divergence"]
    assert fd is not None and fd["layer"] == fault_layer and fd["op"] == "attn_out"
    t = r["table"]
    before = t[(t.metric == "rel_err") & (t.layer < fault_layer)]
    assert (before["value"] < ROUNDING_THRESHOLD).all()


def test_compare_topk_is_a_set_difference_and_first_divergence_order():
    B, T = 1, 3
    pos = torch.tensor([[True, True, False]])
    t_store = {(0, "topk"): torch.tensor([[[1, 2], [3, 4], [0, 0]]]),
               (0, "attn_out"): torch.ones(B, T, 4), (0, "moe_out"): torch.ones(B, T, 4),
               (1, "logits"): torch.ones(B, T, 8)}
    s_store = {(0, "topk"): torch.tensor([[[2, 1], [3, 5], [-1, -1]]]),   # same set; one of two differs
               (0, "attn_out"): torch.ones(B, T, 4) * (1 + 2 ** -9), (0, "moe_out"): torch.ones(B, T, 4) * 1.1,
               (1, "logits"): torch.ones(B, T, 8) * 2}
    tab = compare(t_store, s_store, pos)
    def get(layer, op, metric):
        return float(tab[(tab.layer == layer) & (tab.op == op) & (tab.metric == metric)].value.iloc[0])
    assert get(0, "topk", "topk_disagree") == pytest.approx(0.25)
    assert get(0, "attn_out", "rel_err") == pytest.approx(2 ** -9)
    assert get(0, "moe_out", "rel_err") == pytest.approx(0.1)
    assert first_divergence(tab) == {"layer": 0, "op": "moe_out", "rel_err": pytest.approx(0.1),
                                     "threshold": ROUNDING_THRESHOLD}
    assert first_divergence(pd.DataFrame(columns=tab.columns)) is None


def test_sampler_capture_position_forms():
    cap = SamplerCapture(batch=2, seq_len=5, num_layers=1)
    cap(0, "attn_out", 1, torch.ones(2, 1, 3))                       # int position, [B, 1, H]
    cap(0, "attn_out", torch.tensor([2, 3]), torch.full((2, 3), 2.))  # per-row positions, [B, H]
    cap(0, "attn_out", range(0, 1), torch.full((2, 1, 3), 5.))       # a prefill chunk
    cap(None, "logits", 4, torch.zeros(2, 7))
    d = cap.data[(0, "attn_out")]
    assert d[:, 1].eq(1).all() and d[0, 2].eq(2).all() and d[1, 3].eq(2).all() and d[:, 0].eq(5).all()
    assert torch.isnan(d[0, 3]).all() and (1, "logits") in cap.data
    assert compare_positions(torch.tensor([[0, 0, 1, 1]])).tolist() == [[False, True, True, False]]
