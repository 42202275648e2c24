"""Weight sync: BF16 form re-quantized by the sampler per arm, codes form shipped bit for bit."""
import pytest
import torch

from minite import nvfp4
from minite.engines.arms import load_arm
from minite.engines.models import build_hf_config, build_hf_model, load_model_config
from minite.engines.sampler import Sampler
from minite.engines.sampler_weights import build_sampler_weights, cat_rows, quantize_weight, split_rows
from minite.engines.sync import payload_bytes, payload_from_hf_model, sync_weights


@pytest.fixture(scope="module")
def tiny():
    cfg = load_model_config("tiny")
    hfc = build_hf_config(cfg)
    return cfg, hfc, build_hf_model(cfg, hfc, seed=0)


def test_codes_form_ships_identical_codes(tiny):
    cfg, hfc, model = tiny
    arm = load_arm("minite_nvfp4")
    payload = payload_from_hf_model(model, arm)
    t = payload["tensors"]
    w = build_sampler_weights(payload, arm.sampler, hfc)
    qkv = w.layers[0].qkv.q
    parts = [t[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]
    assert torch.equal(qkv.codes, torch.cat([p.codes for p in parts]))
    assert torch.equal(qkv.scales.view(torch.uint8), torch.cat([p.scales.view(torch.uint8) for p in parts]))
    # per-shard global scales survive fusion as a per-row [N] vector
    assert qkv.global_scale.shape == (qkv.shape[0],)
    assert torch.equal(qkv.global_scale, torch.cat([p.row_global_scale() for p in parts]))
    assert len({float(p.global_scale) for p in parts}) == 3
    gu = t["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(len(gu)):
        assert torch.equal(w.layers[1].experts.gate_up[e].codes, gu[e].codes)
        assert torch.equal(w.layers[1].experts.gate_up[e].global_scale, gu[e].global_scale)
    assert gu[0].global_scale.shape == (2 * cfg["moe_intermediate_size"],)  # gate / up keep their own
    assert w.layers[0].router.q is None and w.lm_head.q is None  # high precision in both engines
    # dequantized fused weight == the shards' dequantized rows
    assert torch.equal(nvfp4.dequantize(qkv), torch.cat([nvfp4.dequantize(p) for p in parts]))


def test_bf16_form_naive_sampler_quantizes_like_modelopt(tiny):
    cfg, hfc, model = tiny
    arm = load_arm("naive_te_nvfp4")
    payload = payload_from_hf_model(model, arm)
    assert payload["form"] == "bf16"
    w = build_sampler_weights(payload, arm.sampler, hfc)
    t = payload["tensors"]
    shards = [t[f"model.layers.0.self_attn.{x}_proj.weight"].float() for x in "qkv"]
    ref = nvfp4.quantize(torch.cat(shards), formula="modelopt", tile=(1, 16), scaling="tensor")
    qkv = w.layers[0].qkv.q
    assert torch.equal(qkv.codes, ref.codes) and qkv.global_scale.dim() == 0
    # shared weight_scale_2 = max over the q/k/v shards' amax / 2688
    amax = max(float(s.abs().max()) for s in shards)
    assert float(qkv.global_scale) == pytest.approx(amax / 2688, rel=1e-6)


def test_naive_sampler_codes_differ_from_trainer_codes(tiny):
    """The naive arm's two engines quantize the same BF16 weights differently: trainer TE 16x16 tiles with a
    per-tensor scale per module, sampler ModelOpt 1x16 with one scale over the fused shards."""
    cfg, hfc, model = tiny
    arm = load_arm("naive_te_nvfp4")
    w = build_sampler_weights(payload_from_hf_model(model, arm), arm.sampler, hfc)
    sd = model.state_dict()
    diff = total = vdiff = 0
    for i in range(cfg["num_hidden_layers"]):
        shards = [sd[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv"]
        te = cat_rows([nvfp4.quantize(s.float(), formula="te", tile=(16, 16), scaling="tensor") for s in shards])
        samp = w.layers[i].qkv.q
        a, b = nvfp4.unpack_codes(te.codes), nvfp4.unpack_codes(samp.codes)
        diff += int((a != b).sum())
        vdiff += int((nvfp4.dequantize(te) != nvfp4.dequantize(samp)).sum())
        total += a.numel()
        gu = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        for e in range(gu.shape[0]):
            te_e = nvfp4.quantize(gu[e].float(), formula="te", tile=(16, 16), scaling="tensor")
            a, b = nvfp4.unpack_codes(te_e.codes), nvfp4.unpack_codes(w.layers[i].experts.gate_up[e].codes)
            diff += int((a != b).sum())
            vdiff += int((nvfp4.dequantize(te_e) != nvfp4.dequantize(w.layers[i].experts.gate_up[e])).sum())
            total += a.numel()
    pct, vpct = 100.0 * diff / total, 100.0 * vdiff / total
    print(f"naive arm: sampler vs trainer weight codes differ on {pct:.1f}% of elements "
          f"(dequantized values on {vpct:.1f}%), attention q/k/v + expert gate/up, tiny model")
    assert 5.0 < pct < 95.0 and vpct > 5.0


def test_sync_weights_through_a_trainer_like_object(tiny):
    cfg, hfc, model = tiny

    class FakeTrainer:
        def __init__(self, arm):
            self.arm = arm

        def export_weights(self):
            return payload_from_hf_model(model, self.arm)

    for name in ("bf16", "minite_nvfp4"):
        arm = load_arm(name)
        s = Sampler(arm, cfg, max_seq_len=16)
        info = sync_weights(FakeTrainer(arm), s)
        assert info["form"] == arm.sync and info["bytes"] > 0 and s.weights is not None
    # codes are ~4.5 bits per weight: far fewer bytes than the BF16 payload
    assert payload_bytes(payload_from_hf_model(model, load_arm("minite_nvfp4"))) < \
        0.5 * payload_bytes(payload_from_hf_model(model, load_arm("bf16")))
    s = Sampler(load_arm("minite_nvfp4"), cfg, max_seq_len=16)
    with pytest.raises(ValueError, match="syncs 'nvfp4_codes'"):
        sync_weights(FakeTrainer(load_arm("bf16")), s)


def test_bad_payloads(tiny):
    cfg, hfc, model = tiny
    arm = load_arm("bf16")
    with pytest.raises(ValueError, match="form"):
        build_sampler_weights({"form": "fp8", "tensors": {}}, arm.sampler, hfc)
    payload = payload_from_hf_model(model, arm)
    del payload["tensors"]["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(KeyError, match="k_proj"):
        build_sampler_weights(payload, arm.sampler, hfc)
    codes = payload_from_hf_model(model, load_arm("minite_nvfp4"))
    with pytest.raises(ValueError, match="high precision"):  # a BF16 sampler cannot take codes
        build_sampler_weights(codes, load_arm("naive_te_nvfp4").override(
            {"sampler.weights": None, "sampler.activations": None, "sampler.precision": "bf16",
             "sampler.gemm": "bf16"}).sampler, hfc)


def test_split_and_cat_rows_round_trip():
    g = torch.Generator().manual_seed(0)
    parts = [nvfp4.quantize(torch.randn(n, 32, generator=g), formula="te") for n in (16, 32, 16)]
    fused = cat_rows(parts)
    for a, b in zip(split_rows(fused, [16, 32, 16]), parts, strict=True):
        assert torch.equal(a.codes, b.codes) and torch.equal(nvfp4.dequantize(a), nvfp4.dequantize(b))
    shared = quantize_weight([torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)],
                             load_arm("naive_te_nvfp4").sampler.weights)
    assert shared.global_scale.dim() == 0
