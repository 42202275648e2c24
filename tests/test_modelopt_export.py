"""ModelOpt-NVFP4 exporter: names / dtypes / shapes vLLM's loader expects, bit-exact read-back on CPU."""
import argparse
import json

import pytest
import torch

from minite import nvfp4
from minite.engines.arms import load_arm
from minite.engines.modelopt_export import export_modelopt, load_modelopt
from minite.engines.models import build_hf_config, build_hf_model, load_model_config
from minite.engines.sampler import Sampler
from minite.engines.sampler_weights import split_rows
from minite.engines.sync import payload_from_hf_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11], [1, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_model_config("tiny")
    return cfg, build_hf_model(cfg, build_hf_config(cfg), seed=0)


def test_round_trip_naive_sampler(tiny, tmp_path):
    cfg, model = tiny
    arm = load_arm("naive_te_nvfp4")
    s = Sampler(arm, cfg, max_seq_len=16)
    s.load_weights(payload_from_hf_model(model, arm))
    amax = s.calibrate(PROMPTS)
    ck = load_modelopt(export_modelopt(s, cfg, tmp_path / "ck"))
    q = ck["quant_config"]["quantization"]
    assert ck["quant_config"]["producer"]["name"] == "modelopt"
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and "kv_cache_quant_algo" in q
    assert "lm_head" in q["exclude_modules"] and "model.layers.0.mlp.gate" in q["exclude_modules"]
    assert ck["config"]["quantization_config"]["quant_method"] == "modelopt"
    assert ck["config"]["architectures"] == ["Qwen3MoeForCausalLM"]
    t = ck["tensors"]
    # q/k/v: separate modules, shared weight_scale_2 and input_scale, codes = the sampler's fused rows
    nq, nkv = 4 * 32, 2 * 32
    parts = split_rows(s.weights.layers[1].qkv.q, [nq, nkv, nkv])
    for x, part in zip("qkv", parts, strict=True):
        m = f"model.layers.1.self_attn.{x}_proj"
        assert t[f"{m}.weight"].dtype == torch.uint8 and t[f"{m}.weight"].shape == (part.shape[0], 64)
        assert t[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
        assert t[f"{m}.weight_scale"].shape == (part.shape[0], 8)
        assert t[f"{m}.weight_scale_2"].shape == () and t[f"{m}.input_scale"].shape == ()
        assert torch.equal(t[f"{m}.weight"], part.codes)
        assert torch.equal(t[f"{m}.weight_scale"].view(torch.uint8), part.scales.view(torch.uint8))
        assert float(t[f"{m}.weight_scale_2"]) == float(s.weights.layers[1].qkv.q.global_scale)
        assert float(t[f"{m}.input_scale"]) == float(amax["model.layers.1.self_attn.qkv_proj"] / 2688)
    # experts per expert, as vLLM's Qwen3-MoE loader names them
    ex = s.weights.layers[0].experts
    for e in range(8):
        g, u = split_rows(ex.gate_up[e], [128, 128])
        p = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(ck["weights"][f"{p}.gate_proj"].codes, g.codes)
        assert torch.equal(ck["weights"][f"{p}.up_proj"].codes, u.codes)
        assert torch.equal(nvfp4.dequantize(ck["weights"][f"{p}.down_proj"]), nvfp4.dequantize(ex.down[e]))
        assert float(ck["input_scale"][f"{p}.down_proj"]) == float(amax["model.layers.0.mlp.experts.down"] / 2688)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.q_norm.weight", "model.norm.weight"):
        assert t[name].dtype == torch.bfloat16
    assert torch.equal(t["lm_head.weight"], model.lm_head.weight.to(torch.bfloat16))


def test_round_trip_codes_payload(tiny, tmp_path):
    cfg, model = tiny
    payload = payload_from_hf_model(model, load_arm("minite_nvfp4"))
    amax = {}
    for i in range(2):
        amax.update({f"model.layers.{i}.self_attn.qkv_proj": torch.tensor(3.0),
                     f"model.layers.{i}.self_attn.o_proj": torch.tensor(1.5),
                     f"model.layers.{i}.mlp.experts.gate_up": torch.tensor(4.0),
                     f"model.layers.{i}.mlp.experts.down": torch.tensor(0.5)})
    ck = load_modelopt(export_modelopt(payload, cfg, tmp_path / "ck", input_amax=amax,
                                       arm=load_arm("minite_nvfp4")))
    for x in "qkvo":  # the trainer's codes, bit for bit, each module its own weight_scale_2
        src = payload["tensors"][f"model.layers.1.self_attn.{x}_proj.weight"]
        got = ck["weights"][f"model.layers.1.self_attn.{x}_proj"]
        assert torch.equal(got.codes, src.codes) and torch.equal(got.global_scale, src.global_scale)
        assert torch.equal(got.scales.view(torch.uint8), src.scales.view(torch.uint8))
    gu = payload["tensors"]["model.layers.0.mlp.experts.gate_up_proj"][3]
    got = torch.cat([nvfp4.dequantize(ck["weights"][f"model.layers.0.mlp.experts.3.{p}_proj"]) for p in ("gate", "up")])
    assert torch.equal(got, nvfp4.dequantize(gu))
    with pytest.raises(ValueError, match="calibrated input amax"):
        export_modelopt(payload, cfg, tmp_path / "missing")
    assert not (tmp_path / "missing" / "model.safetensors").exists()


def test_export_errors(tiny, tmp_path):
    cfg, model = tiny
    s = Sampler(load_arm("bf16"), cfg, max_seq_len=16)
    s.load_weights(payload_from_hf_model(model, load_arm("bf16")))
    with pytest.raises(ValueError, match="nothing to export"):
        export_modelopt(s, cfg, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="not a ModelOpt"):
        load_modelopt(tmp_path)


def test_export_job(tmp_path):
    from minite.jobs import export_modelopt as job

    p = argparse.ArgumentParser()
    job.add_args(p)
    args = p.parse_args(["--arm", "naive_te_nvfp4", "--model", "tiny", "--out", str(tmp_path / "job"),
                         "--calib-prompts", "4"])
    assert job.run(args) == 0
    quant = json.loads((tmp_path / "job" / "hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "NVFP4"
    assert json.loads((tmp_path / "job" / "export_provenance.json").read_text())["arm"] == "naive_te_nvfp4"
    from minite.cli import main
    assert main(["export-modelopt", "--arm", "bf16", "--out", str(tmp_path / "bf16")]) == 2
