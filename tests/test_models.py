"""Model configs: the three YAMLs, schema + GEMM-dimension validation, the upstream HF classes."""
import pytest
import torch
import yaml

from minite.engines import models as M
from minite.engines.models import ModelConfigError, load_model_config
from minite.yamlconfig import config_dir


def test_shipped_models_validate_and_match_the_contract():
    tiny = load_model_config("tiny")
    assert (tiny["vocab_size"], tiny["hidden_size"], tiny["num_hidden_layers"]) == (32, 128, 2)
    assert (tiny["num_attention_heads"], tiny["num_key_value_heads"], tiny["head_dim"]) == (4, 2, 32)
    assert (tiny["num_experts"], tiny["num_experts_per_tok"], tiny["moe_intermediate_size"]) == (8, 2, 128)
    small = load_model_config("small")
    assert 100e6 <= M.count_params(small)["total"] <= 300e6
    q = load_model_config("qwen3_30b_a3b")
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_experts"], q["num_experts_per_tok"]) == (2048, 48, 128, 8)
    counts = M.count_params(q)
    assert 30.0e9 < counts["total"] < 31.0e9 and 3.0e9 < counts["active"] < 3.6e9  # "30B-A3B"


def test_qwen3_hf_config_is_the_real_architecture_and_layers_slice():
    cfg = load_model_config("qwen3_30b_a3b", num_layers=2)
    hc = M.build_hf_config(cfg)
    assert type(hc).__name__ == "Qwen3MoeConfig"
    assert hc.num_hidden_layers == 2 and hc.hidden_size == 2048 and hc.head_dim == 128
    assert hc.num_attention_heads == 32 and hc.num_key_value_heads == 4 and hc.vocab_size == 151936
    assert hc.rope_parameters["rope_theta"] == 1e6 and hc.tie_word_embeddings is False
    assert hc.num_experts == 128 and hc.moe_intermediate_size == 768 and hc.norm_topk_prob is True


def test_tiny_builds_upstream_model_with_expected_parameters():
    cfg = load_model_config("tiny")
    model = M.build_hf_model(cfg, M.build_hf_config(cfg), seed=3)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    names = dict(model.named_parameters())
    assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 256, 128)
    assert names["model.layers.0.mlp.experts.down_proj"].shape == (8, 128, 128)
    assert names["model.layers.1.self_attn.k_proj.weight"].shape == (64, 128)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    again = M.build_hf_model(cfg, M.build_hf_config(cfg), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))  # seeded init


def test_unknown_model_lists_known_ones():
    with pytest.raises(ModelConfigError, match="known models: .*tiny"):
        load_model_config("gpt5")


def test_malformed_yaml_and_schema_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ModelConfigError, match="not valid YAML"):
        load_model_config(bad)
    raw = yaml.safe_load((config_dir("model") / "tiny.yaml").read_text())
    for change, msg in [({"hidden_sizee": 1}, "Additional properties"), ({"num_experts": "8"}, "num_experts")]:
        p = tmp_path / "m.yaml"
        p.write_text(yaml.safe_dump({**raw, **change}))
        with pytest.raises(ModelConfigError, match=msg):
            load_model_config(p)
    del raw["head_dim"]
    with pytest.raises(ModelConfigError, match="head_dim"):
        load_model_config(raw)


def test_gemm_dims_not_multiple_of_16_rejected():
    raw = load_model_config("tiny")
    with pytest.raises(ModelConfigError, match="multiples of 16.*q_proj K=120"):
        load_model_config({**raw, "hidden_size": 120})
    with pytest.raises(ModelConfigError, match="experts.gate_up_proj N=200"):
        load_model_config({**raw, "moe_intermediate_size": 100})
    with pytest.raises(ModelConfigError, match="num_layers=3"):
        load_model_config("tiny", num_layers=3)


def test_head_and_expert_counts_rejected_with_their_own_message():
    raw = load_model_config("tiny")
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\) is not a multiple of num_key_value_heads"):
        load_model_config({**raw, "num_attention_heads": 4, "num_key_value_heads": 3})
    with pytest.raises(ModelConfigError, match=r"num_experts_per_tok \(99\) > num_experts") as e:
        load_model_config({**raw, "num_experts_per_tok": 99})
    assert "multiples of 16" not in str(e.value)


def test_checkpoint_must_be_a_local_hf_dir(tmp_path):
    cfg = load_model_config("tiny")
    with pytest.raises(ModelConfigError, match="never downloads"):
        M.build_hf_model(cfg, M.build_hf_config(cfg), checkpoint=str(tmp_path))


def test_local_checkpoint_round_trip_and_layer_slice(tmp_path):
    cfg = load_model_config("tiny")
    model = M.build_hf_model(cfg, M.build_hf_config(cfg), seed=1)
    model.save_pretrained(tmp_path)
    sliced = load_model_config("tiny", num_layers=1)
    loaded = M.build_hf_model(sliced, M.build_hf_config(sliced), checkpoint=str(tmp_path))
    assert len(loaded.model.layers) == 1
    a = dict(model.named_parameters())
    for n, p in loaded.named_parameters():
        assert torch.equal(p, a[n]), n


def test_transformers_extension_points_exist():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from minite.engines.attention import register_attention
    from minite.engines.experts import register_experts

    name = register_experts()
    assert name in ALL_EXPERTS_FUNCTIONS and "grouped_mm" in ALL_EXPERTS_FUNCTIONS
    from transformers import AttentionInterface
    assert register_attention() in AttentionInterface._global_mapping
