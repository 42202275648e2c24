"""The training engine on CPU with the tiny model: updates, logprobs, NVFP4 autograd, weight cache, resume."""
import pytest
import torch

from minite import nvfp4
from minite.engines import quant_linear as Q
from minite.engines.arms import ARMS, ArmError, QuantSpec, load_arm
from minite.engines.trainer import Trainer


def _batch(b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32, (b, t), generator=g)
    ids[:, 0] = 1
    am = torch.ones_like(ids)
    am[-1, t - 4:] = 0                      # one right-padded row
    ids[-1, t - 4:] = 0
    lm = am.clone()
    lm[:, :4] = 0                           # "prompt" tokens are not trained on
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


@pytest.mark.parametrize("arm", ARMS)
def test_updates_lower_the_loss_and_logprobs_are_sane(arm):
    tr = Trainer(arm, "tiny", lr=3e-3, micro_batch_size=1)
    batch = _batch()
    losses = [tr.update(batch)["loss"] for _ in range(3)]
    assert losses[2] < losses[1] < losses[0], losses
    lp = tr.logprobs(batch["input_ids"], batch["attention_mask"])
    assert lp.shape == (2, 15) and lp.dtype == torch.float32
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    # the default loss is the masked mean NLL of the current weights: recomputing it matches (eval mode)
    m = batch["loss_mask"][:, 1:].float()
    nll = float(-(lp * m).sum() / m.sum())
    assert nll < losses[0]


def test_update_report_fields():
    tr = Trainer("naive_te_nvfp4", "tiny", micro_batch_size=1)
    r = tr.update(_batch())
    assert set(r["times"]) == {"quantize", "gemm", "other", "optimizer"}
    assert r["tokens"] == 2 * 16 - 4 and r["grad_norm"] > 0 and r["times"]["optimizer"] > 0
    assert r["weight_quantizations"] > 0 and r["act_quantizations"] > 0
    t = r["times"]
    assert t["quantize"] > 0 and t["gemm"] > 0 and t["other"] > 0
    assert t["quantize"] + t["gemm"] + t["other"] + t["optimizer"] == pytest.approx(r["time_s"])
    assert Trainer("bf16", "tiny").update(_batch())["times"]["gemm"] is None   # not separable in HF modules


def test_update_without_split_timing_times_no_block():
    tr = Trainer("minite_nvfp4", "tiny", micro_batch_size=1)
    tr.qstate.split_timing = False
    calls = []
    tr.qstate._timed = lambda *a: calls.append(a)      # the instrumented path must not be entered
    r = tr.update(_batch())
    t = r["times"]
    assert calls == [] and t["quantize"] is None and t["gemm"] is None
    assert t["other"] + t["optimizer"] == pytest.approx(r["time_s"]) and t["other"] > 0


def _n_quantized(tr):
    lin = sum(isinstance(m, Q.NVFP4Linear) or hasattr(m, "cache") for m in tr.model.modules())
    return lin + 2 * sum(getattr(m, "minite_quant", None) is not None for m in tr.model.modules())


def test_minite_weight_cache_quantizes_once_per_update_and_export_ships_those_codes():
    tr = Trainer("minite_nvfp4", "tiny", micro_batch_size=1)          # 2 micro-batches per update
    n = _n_quantized(tr)
    assert n == 2 * (4 + 2)                                           # q/k/v/o + 2 expert tensors, router BF16
    st = tr.qstate
    tr.update(_batch())
    assert st.weight_quantizations == n                               # 2 micro-batches, quantized once
    q_mod = tr.model.model.layers[0].self_attn.q_proj
    cached = q_mod.quantized()                                        # the new weights: quantized once more
    assert st.weight_quantizations == 2 * n - (n - 1)
    tr.logprobs(_batch()["input_ids"])
    payload = tr.export_weights()
    assert st.weight_quantizations == 2 * n                           # logprobs + export reuse the cache
    assert payload["form"] == "nvfp4_codes"
    shipped = payload["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert shipped.codes is cached.codes and shipped.global_scale.dim() == 0
    experts = payload["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(experts, list) and len(experts) == 8
    assert experts[0].shape == (256, 128) and experts[0].global_scale.shape == (256,)  # per-shard gate/up
    gate = tr.model.model.layers[1].mlp.experts.gate_up_proj[0, :128]
    ref = nvfp4.quantize(gate, formula="te", tile=(16, 16), scaling="tensor")
    assert torch.equal(experts[0].codes[:128], ref.codes)
    assert payload["tensors"]["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16   # high precision
    tr.update(_batch())                                               # its forwards use the shipped codes
    assert st.weight_quantizations == 2 * n
    assert q_mod.quantized() is not cached                            # after the step: stale, re-quantized


def test_naive_arm_requantizes_every_forward_and_quantizes_the_router():
    """The blanket te.Linear swap quantizes the router; the Megatron-core deployment (the default naive arm)
    keeps it BF16."""
    assert _n_quantized(Trainer("naive_te_nvfp4", "tiny")) == 2 * (4 + 2)
    tr = Trainer("naive_te_nvfp4_blanket", "tiny", micro_batch_size=1)
    n = _n_quantized(tr)
    assert n == 2 * (4 + 1 + 2)
    tr.update(_batch())
    assert tr.qstate.weight_quantizations == 2 * n                    # 2 micro-batches, 2 forwards
    assert tr.export_weights()["form"] == "bf16"


def test_grouped_te_weight_quantizer_is_bit_exact_with_the_reference():
    torch.manual_seed(0)
    w = (torch.randn(3, 64, 48) * torch.rand(3, 1, 1) * 3).bfloat16()
    w[1, 32:] *= 8
    q = Q.quantize_weight(w, QuantSpec("te", (16, 16), "tensor", "per_shard"), shards=2)
    for e in range(3):
        for s in range(2):
            rows = slice(32 * s, 32 * s + 32)
            ref = nvfp4.quantize(w[e, rows], formula="te", tile=(16, 16), scaling="tensor")
            assert torch.equal(ref.codes, q.codes[e, rows])
            assert torch.equal(ref.scales.view(torch.uint8), q.scales[e, rows].view(torch.uint8))
            assert torch.equal(ref.global_scale.expand(32), q.global_scale[e, rows])
            assert torch.equal(nvfp4.dequantize(ref).bfloat16(), q.dq[e, rows])
    shared = Q.quantize_weight(w[0], QuantSpec("te", (16, 16), "tensor", "shared"), shards=2)
    ref = nvfp4.quantize(w[0], formula="te", tile=(16, 16), scaling="tensor")
    assert torch.equal(shared.codes, ref.codes) and shared.global_scale.shape == ()
    with pytest.raises(ValueError, match="K % 16"):
        Q.quantize_weight(torch.randn(16, 24), QuantSpec("te", (16, 16), "tensor"))


def _linear_grads(recipe, seed):
    torch.manual_seed(1)
    st = Q.QuantState(recipe, cache_per_update=False, seed=seed)
    w = torch.nn.Parameter((torch.randn(64, 128) * 0.05).bfloat16())
    x = torch.randn(2, 40, 128).bfloat16().requires_grad_()
    g = torch.randn(2, 40, 64).bfloat16()
    y = Q.NVFP4Linear(w, st)(x)
    y.backward(g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (xr @ wr.T).backward(g.float())
    return x.grad, w.grad, xr.grad, wr.grad, (x, w, g, st)


@pytest.mark.parametrize("arm", ["naive_te_nvfp4", "minite_nvfp4"])
def test_nvfp4_linear_backward_close_to_bf16_and_sr_deterministic_under_seed(arm):
    recipe = load_arm(arm).trainer
    dx, dw, dx_ref, dw_ref, _ = _linear_grads(recipe, seed=0)
    for got, ref in ((dx, dx_ref), (dw, dw_ref)):
        rel = float((got.float() - ref).norm() / ref.norm())
        assert rel < 0.25, rel        # two FP4 operands: ~0.1 RMS each (measured ~0.17 with SR)
    dx2, dw2, *_ = _linear_grads(recipe, seed=0)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)      # same seed, same stochastic rounding
    dx3, dw3, *_ = _linear_grads(recipe, seed=1)
    assert not torch.equal(dx, dx3) and not torch.equal(dw, dw3)


def test_dgrad_uses_the_quantized_weight_exactly():
    arm = load_arm("naive_te_nvfp4").override({"trainer.backward": {"rounding": "nearest", "rht": False}})
    dx, dw, _, _, (x, w, g, st) = _linear_grads(arm.trainer, seed=0)
    wq = nvfp4.quantize(w.detach(), formula="te", tile=(16, 16), scaling="tensor")
    g2 = g.reshape(-1, 64)
    dyq = nvfp4.dequantize(nvfp4.quantize(g2, formula="te")).bfloat16()
    assert torch.equal(dx.reshape(-1, 128), dyq @ nvfp4.dequantize(wq).bfloat16())
    x2, gp = x.detach().reshape(-1, 128), g2                  # 80 tokens: already whole 16-blocks
    dyt = nvfp4.dequantize(nvfp4.quantize(gp.t().contiguous(), formula="te")).bfloat16()
    xt = nvfp4.dequantize(nvfp4.quantize(x2.t().contiguous(), formula="te")).bfloat16()
    assert torch.equal(dw, dyt @ xt.T)


def test_nvfp4_model_gradients_track_bf16_gradients():
    batch = _batch()
    grads = {}
    for arm in ("bf16", "naive_te_nvfp4"):
        tr = Trainer(arm, "tiny", seed=5)
        tr.update(batch)
        grads[arm] = {n: m.grad.clone() for n, m in zip(tr.names, tr.master, strict=True)}
    # (expert and router gradients move more: FP4 forward noise flips near-tied routing decisions of a
    # random-init router, so the test below checks the experts' autograd with the routing held fixed)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "lm_head.weight"):
        a, b = grads["bf16"][name].flatten(), grads["naive_te_nvfp4"][name].flatten()
        cos = float(a @ b / (a.norm() * b.norm()))
        assert cos > 0.8, (name, cos)


@pytest.mark.parametrize("arm", ["naive_te_nvfp4", "minite_nvfp4"])
def test_nvfp4_experts_forward_backward_close_to_bf16_with_fixed_routing(arm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from minite.engines import experts as X
    from minite.engines.models import build_hf_config, load_model_config

    hc = build_hf_config(load_model_config("tiny"), experts_implementation=X.register_experts())
    torch.manual_seed(0)
    mod = Qwen3MoeExperts(hc).to(torch.bfloat16)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.05)
        mod.down_proj.normal_(0, 0.05)
    x = torch.randn(40, 128).bfloat16()
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    idx[:, 0] = torch.where(torch.arange(40) < 3, 7, idx[:, 0])   # expert 7 gets few tokens
    idx[idx == 5] = 6                                                  # expert 5 gets none
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 5, idx[:, 1])
    wts = torch.softmax(torch.randn(40, 2), -1).bfloat16()
    g = torch.randn(40, 128).bfloat16()

    def run(quant):
        mod.minite_quant = X.ExpertsQuant(Q.QuantState(load_arm(arm).trainer, False, seed=0)) if quant else None
        xi = x.clone().requires_grad_()
        mod.zero_grad()
        out = mod(xi, idx, wts)
        out.backward(g)
        return [t.detach().float() for t in (out, xi.grad, mod.gate_up_proj.grad, mod.down_proj.grad)]

    ref, got = run(False), run(True)
    for r, q, what in zip(ref, got, ("out", "dx", "dgate_up", "ddown"), strict=True):
        rel = float((q - r).norm() / r.norm())
        assert rel < 0.3, (what, rel)
    assert got[2][5].abs().max() == 0 and got[3][5].abs().max() == 0     # no tokens, no gradient


def test_save_load_round_trip_gives_identical_next_update(tmp_path):
    b1, b2 = _batch(seed=1), _batch(seed=2)
    tr = Trainer("naive_te_nvfp4", "tiny", lr=1e-3, micro_batch_size=1)   # SR: the RNG state matters
    tr.update(b1)
    tr.save(tmp_path / "ck.pt")
    want = tr.update(b2)
    other = Trainer("naive_te_nvfp4", "tiny", lr=1e-3, seed=9, micro_batch_size=1)
    other.load(tmp_path / "ck.pt")
    got = other.update(b2)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(tr.master, other.master, strict=True))
    wrong = Trainer("bf16", "tiny")
    with pytest.raises(ValueError, match="checkpoint .* is for"):
        wrong.load(tmp_path / "ck.pt")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ArmError, match="unknown arm"):
        Trainer("fp3", "tiny")
    tr = Trainer("bf16", "tiny")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tr.logprobs(torch.full((1, 4), 40))
    with pytest.raises(ValueError, match="long"):
        tr.logprobs(torch.ones(1, 4))


def test_trainer_from_local_checkpoint_keeps_minite_implementations(tmp_path):
    src = Trainer("bf16", "tiny", seed=4)
    src.model.save_pretrained(tmp_path)
    tr = Trainer("minite_nvfp4", "tiny", checkpoint=str(tmp_path))
    assert tr.model.config._experts_implementation == "minite_nvfp4"
    assert tr.model.config._attn_implementation == "minite_trainer_invariant"
    ids = _batch()["input_ids"]
    assert torch.equal(tr.model.model.embed_tokens.weight, src.model.model.embed_tokens.weight)
    lp_src, lp = src.logprobs(ids), tr.logprobs(ids)
    assert (lp - lp_src).abs().max() < 0.5           # same weights, FP4 forward: close, not equal
    assert not torch.equal(lp, lp_src)


@pytest.mark.parametrize("arm", ["bf16", "minite_nvfp4"])
def test_trainer_masks_give_the_bits_of_transformers_own(arm):
    """The trainer passes its own masks (no host read per forward): log-probs (with and without autograd) and
    gradients equal those of the same model under transformers' mask creation, for a left- and a right-padded
    row and for no padding."""
    from minite.engines.attention import register_attention

    tr = Trainer(arm, "tiny", seed=5)
    batch = _batch(b=3)
    ids, am = batch["input_ids"], batch["attention_mask"]
    am[0, :3] = 0                                                      # a left-padded row too
    ours = tr.model.config._attn_implementation
    hf_name = "sdpa" if arm == "bf16" else register_attention()     # the same attention with HF's masks

    def logprobs(name, mask):
        tr.model.config._attn_implementation = name
        if name == ours:
            return tr._token_logprobs(ids, mask)
        lp = torch.log_softmax(tr.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        return lp.gather(-1, ids[:, 1:, None])[..., 0]

    def run(name, mask):
        tr.model.zero_grad(set_to_none=True)
        tr._seed_rounding(0)                                          # the same stochastic rounding draws
        lp = logprobs(name, mask)
        (lp * am[:, 1:]).sum().backward()
        with torch.no_grad():
            nograd = logprobs(name, mask)
        return lp.detach(), [p.grad.clone() for p in tr.model.parameters() if p.grad is not None], nograd

    try:
        for mask in (am, None):
            lp, grads, nograd = run(ours, mask)
            lp_hf, grads_hf, nograd_hf = run(hf_name, mask)
            assert torch.equal(lp, lp_hf) and torch.equal(nograd, nograd_hf)
            assert len(grads) == len(grads_hf) > 0
            assert all(torch.equal(a, b) for a, b in zip(grads, grads_hf, strict=True))
    finally:
        tr.model.config._attn_implementation = ours


def test_weight_cache_override():
    tr = Trainer("naive_te_nvfp4", "tiny", micro_batch_size=1, weight_cache="per_update")
    tr.update(_batch())
    assert tr.qstate.weight_quantizations == _n_quantized(tr)
    with pytest.raises(ValueError, match="per_update"):
        Trainer("minite_nvfp4", "tiny", weight_cache="per_forward")


def test_rotary_keeps_fp32_inv_freq_as_upstream_loading_does():
    # .to(bfloat16) on a built model would round HF's inv_freq buffer; from_pretrained/from_config with
    # dtype= keep it fp32 — the sampler builds its rotary from the same config in fp32, so this matters
    tr = Trainer("bf16", "tiny")
    assert tr.model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_aligned_arm_trainer_and_sampler_logprobs_are_bit_identical():
    from minite.engines import build_engines

    tr, sa = build_engines("minite_nvfp4", "tiny", seed=3)
    tr.update(_batch())
    from minite.engines.sync import sync_weights
    sync_weights(tr, sa)
    ids = _batch(b=2, t=14, seed=7)["input_ids"][:, :14].clone()
    ids[ids == 0] = 5
    lens = torch.tensor([4, 6])
    lp_t = tr.logprobs(ids)                               # [B, T-1]: token t at column t-1
    lp_s = sa.score(ids, lens)                            # [B, T]: decode-path replay, 0 on the prompt
    for b in range(2):
        assert torch.equal(lp_t[b, lens[b] - 1:], lp_s[b, lens[b]:]), (lp_t[b] - lp_s[b, 1:]).abs().max()


def test_te_backend_missing_is_a_clear_error():
    pytest.importorskip("transformers")
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine installed")
    except ImportError:
        pass
    arm = load_arm("naive_te_nvfp4").override({"trainer.gemm": "te"})
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        Trainer(arm, "tiny")


def test_high_precision_first_layer_stays_bf16():
    arm = load_arm("naive_te_nvfp4_blanket").override(
        {"trainer.high_precision": ["embed_tokens", "lm_head", "first_layer"]})
    tr = Trainer(arm, "tiny")
    l0, l1 = tr.model.model.layers
    assert type(l0.self_attn.q_proj) is torch.nn.Linear and getattr(l0.mlp.experts, "minite_quant", None) is None
    assert not hasattr(l0.mlp.gate, "cache")
    assert isinstance(l1.self_attn.q_proj, Q.NVFP4Linear) and l1.mlp.experts.minite_quant is not None
    assert hasattr(l1.mlp.gate, "cache")                  # the blanket naive arm quantizes the router
    assert tr.update(_batch())["loss"] > 0


def test_loss_contract_slice_sums_over_the_batch_loss_tokens():
    """A loss returns its micro-batch slice's SUM; the trainer divides by the whole batch's loss tokens. The
    default NLL and the same sum given as a custom loss are one objective, and the slice sees the batch counts."""
    b, seen = _batch(b=3), []

    def nll_sum(lp, sub):
        seen.append((sub["_n_tokens"], sub["_n_sequences"], lp.shape[0]))
        return -(lp * sub["loss_mask"][:, 1:]).sum()

    want = Trainer("bf16", "tiny", micro_batch_size=2).update(b)
    got = Trainer("bf16", "tiny", micro_batch_size=2).update(b, loss_fn=nll_sum)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    n = int(b["loss_mask"][:, 1:].sum())
    assert seen == [(n, 3, 2), (n, 3, 1)]
    lp = Trainer("bf16", "tiny").logprobs(b["input_ids"], b["attention_mask"])
    assert want["loss"] == pytest.approx(float(-(lp * b["loss_mask"][:, 1:]).sum() / n), rel=1e-5)


def test_sft_hooks_learning_rate_and_compute_dtype():
    tr = Trainer("bf16", "tiny", lr=1e-3, compute_dtype="float32")
    assert all(p.dtype == torch.float32 for p in tr.params)
    tr.set_lr(2.5e-4)
    assert [g["lr"] for g in tr.optimizer.param_groups] == [2.5e-4]
    assert Trainer("bf16", "tiny").params[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="compute_dtype"):
        Trainer("bf16", "tiny", compute_dtype="float16")
