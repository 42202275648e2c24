"""Arms: the three YAMLs load, every malformed or impossible arm is refused with a message naming the problem,
overrides re-validate; plus the small shared pieces the arms rely on (hp_linear, invariant attention)."""
import pytest
import torch
import yaml

from minite.engines.arms import ARMS, ArmError, QuantSpec, load_arm
from minite.engines.attention import invariant_attention
from minite.engines.gemm import hp_linear


def test_three_arms_load_with_their_contracts():
    arms = {a: load_arm(a) for a in ARMS}
    assert arms["bf16"].sync == "bf16" and not arms["bf16"].trainer.is_nvfp4
    naive = arms["naive_te_nvfp4"]
    assert naive.trainer.weights == QuantSpec("te", (16, 16), "tensor", "per_shard")
    assert naive.sampler.weights.formula == "modelopt" and naive.sampler.weights.fused_shards == "shared"
    assert naive.sampler.activations.scaling == "static" and naive.sampler.activations.formula == "vllm"
    # the Megatron-core deployment: the router stays BF16 in both engines; the blanket te.Linear swap
    # quantizes it in the trainer
    assert "router" in naive.trainer.high_precision and "router" in naive.sampler.high_precision
    blanket = arms["naive_te_nvfp4_blanket"]
    assert "router" not in blanket.trainer.high_precision and "router" in blanket.sampler.high_precision
    assert (blanket.sync, blanket.sampler) == (naive.sync, naive.sampler)
    tis = arms["naive_te_nvfp4_tis"]
    assert tis.rl == {"tis_cap": 2.0} and naive.rl == {} and arms["bf16"].rl == {}
    assert (tis.sync, tis.trainer, tis.sampler) == (naive.sync, naive.trainer, naive.sampler)
    aligned = arms["minite_nvfp4"]
    assert aligned.sync == "nvfp4_codes" and aligned.sampler.weights == "from_trainer"
    assert aligned.trainer.activations == aligned.sampler.activations
    assert aligned.trainer.gemm == aligned.sampler.gemm == "kernel"
    assert aligned.trainer.hp_gemm == aligned.sampler.hp_gemm == "invariant"


def test_arm_rl_block_takes_only_the_mismatch_correction(tmp_path):
    raw = load_arm("naive_te_nvfp4_tis").raw
    with pytest.raises(ArmError, match="Additional properties"):
        load_arm(_write(tmp_path, {**raw, "rl": {"tis_cap": 2.0, "lr": 1e-3}}))
    with pytest.raises(ArmError, match="tis_cap"):
        load_arm(_write(tmp_path, {**raw, "rl": {"tis_cap": 0}}))


def test_unknown_arm_lists_known_ones():
    with pytest.raises(ArmError, match="known arms: bf16, minite_nvfp4, naive_te_nvfp4"):
        load_arm("fp8_magic")


def _write(tmp_path, raw):
    p = tmp_path / "arm.yaml"
    p.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return p


def test_malformed_yaml_and_schema_errors(tmp_path):
    with pytest.raises(ArmError, match="not valid YAML"):
        load_arm(_write(tmp_path, "name: [unclosed"))
    with pytest.raises(ArmError, match="expected a mapping"):
        load_arm(_write(tmp_path, "- just\n- a list\n"))
    raw = dict(load_arm("bf16").raw)
    del raw["sampler"]
    with pytest.raises(ArmError, match="'sampler' is a required property"):
        load_arm(_write(tmp_path, raw))
    raw = load_arm("bf16").raw | {"colour": "blue"}
    with pytest.raises(ArmError, match="Additional properties"):
        load_arm(_write(tmp_path, raw))


@pytest.mark.parametrize("changes,match", [
    ({"trainer.gemm": "fast"}, "is not one of"),
    ({"trainer.gemm": "bf16"}, "nvfp4 needs gemm"),
    ({"sync": "nvfp4_codes"}, "from_trainer"),
    ({"sampler.gemm": "te"}, "trainer backend"),
    ({"trainer.activations": {"formula": "te", "tile": [16, 16], "scaling": "tensor"}}, "1x16 blocks"),
    ({"trainer.activations": {"formula": "vllm", "tile": [1, 16], "scaling": "static"}}, "serving"),
    ({"trainer.weights": {"formula": "te", "tile": [16, 16], "scaling": "row"}}, "row scaling"),
    ({"sampler.weights": "from_trainer"}, "needs sync: nvfp4_codes"),
])
def test_impossible_combinations_refused(changes, match):
    with pytest.raises(ArmError, match=match):
        load_arm("naive_te_nvfp4").override(changes)


def test_codes_sync_needs_equal_high_precision_sets():
    with pytest.raises(ArmError, match="same modules in high precision"):
        load_arm("minite_nvfp4").override({"trainer.high_precision": ["embed_tokens", "lm_head"]})


def test_override_returns_a_revalidated_copy():
    naive = load_arm("naive_te_nvfp4")
    spec = {"formula": "te", "tile": [1, 16], "scaling": "row"}
    arm = naive.override({"sampler.activations": spec, "sampler.gemm": "kernel"}, name="naive_rowacts")
    assert arm.name == "naive_rowacts" and arm.sampler.activations == QuantSpec("te", (1, 16), "row")
    assert arm.sampler.gemm == "kernel" and naive.sampler.gemm == "emulated"  # the original is untouched


def test_hp_linear_is_row_invariant_only_on_log_prob_paths():
    torch.manual_seed(0)
    x, w = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(40, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        full = hp_linear(x, w, invariant=True)
        rows = torch.cat([hp_linear(x[i:i + 1], w, invariant=True) for i in range(64)])
        exact = (x.double() @ w.double().T).to(torch.bfloat16)
    assert torch.equal(full, rows) and torch.equal(full, exact)
    xg = x.clone().requires_grad_(True)
    y = hp_linear(xg, w, invariant=True)  # autograd on: the ordinary BF16 linear, differentiable
    y.float().sum().backward()
    assert xg.grad is not None and torch.equal(y.detach(), torch.nn.functional.linear(x, w))


def test_invariant_attention_decode_equals_full_sequence():
    torch.manual_seed(1)
    b, hq, hkv, t, d = 2, 4, 2, 9, 16
    q = torch.randn(b, hq, t, d, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, dtype=torch.bfloat16)
    full = invariant_attention(q, k, v, d ** -0.5)                       # [B, T, Hq, D], causal
    for i in range(t):  # one decode step: query i against the i + 1 cached keys
        step = invariant_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], d ** -0.5)
        assert torch.equal(step[:, 0], full[:, i])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        invariant_attention(q[:, :3], k, v, 1.0)
