"""minite.align: refusals with clear reasons, bitwise code verification, exact alignment on tiny (CPU)."""
import pytest

from minite.align import AlignmentError, align, blockers, compare_codes, contract_arm, verify_alignment
from minite.diagnostics.attribution import same_recipe
from minite.engines.arms import ArmError, load_arm
from minite.engines.models import load_model_config


def test_contract_of_the_aligned_arm_is_itself():
    arm = load_arm("minite_nvfp4")
    assert blockers(arm) == []
    assert same_recipe(contract_arm(arm), arm)


@pytest.mark.parametrize("arm, why", [
    (lambda: load_arm("bf16"), "BF16"),
    (lambda: load_arm("naive_te_nvfp4_blanket"), "high-precision"),
    (lambda: load_arm("minite_nvfp4").override({"trainer.gemm": "te"}, name="te_arm"), "Transformer Engine"),
])
def test_unalignable_arms_are_refused(arm, why):
    with pytest.raises(AlignmentError, match=why) as e:
        contract_arm(arm())
    assert isinstance(e.value, ArmError)


def test_naive_with_equal_exceptions_becomes_the_contract():
    naive = load_arm("naive_te_nvfp4_blanket").override(
        {"trainer.high_precision": ["embed_tokens", "router", "lm_head"]}, name="naive_hp")
    c = contract_arm(naive)
    assert c.sync == "nvfp4_codes" and c.sampler.weights == "from_trainer"
    assert c.trainer.activations == c.sampler.activations and c.trainer.activations.scaling == "row"
    assert {c.trainer.gemm, c.sampler.gemm} == {"kernel"} and c.sampler.non_gemm == "hf"


# ------------------------------------------------------------------------------------------ on engines
PROBE = {"n_probe": 3, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def cfg():
    return load_model_config("tiny")


@pytest.fixture(scope="module")
def trainer(cfg):
    from minite.engines.trainer import Trainer
    return Trainer(load_arm("minite_nvfp4"), cfg, seed=0)


def _sampler(arm_name, cfg):
    from minite.engines.sampler import Sampler
    return Sampler(load_arm(arm_name), cfg, max_batch=4, max_seq_len=32)


def test_align_rebuilds_a_foreign_sampler_and_verifies_exactly(trainer, cfg):
    rep = align(trainer, _sampler("bf16", cfg), **PROBE)   # strict: raises unless codes identical and k3 == 0
    assert rep.ok and rep.codes_identical and rep.mismatched == []
    assert rep.weights_checked > 0 and rep.probe["k3"] == 0.0 and rep.probe["n_tokens"] > 0
    assert any(d.startswith("sampler.gemm") for d in rep.sampler_rebuilt)
    assert rep.sampler.arm.sampler.weights == "from_trainer"


def test_one_flipped_code_is_caught(trainer, cfg):
    rep = align(trainer, _sampler("minite_nvfp4", cfg), **PROBE)
    assert rep.sampler_rebuilt == []
    s = rep.sampler
    s.weights.layers[1].o.q.codes[0, 0] ^= 0x1
    n, bad = compare_codes(trainer, s)
    assert n == rep.weights_checked and bad == ["model.layers.1.self_attn.o_proj.weight"]
    again = verify_alignment(trainer, s, **PROBE)
    assert not again.ok and not again.codes_identical


def test_trainer_not_built_for_the_contract_is_refused(cfg):
    from minite.engines.trainer import Trainer
    arm = load_arm("minite_nvfp4").override({"trainer.gemm": "emulated", "sampler.gemm": "emulated"},
                                           name="emulated")
    tr = Trainer(arm, cfg, seed=0)
    with pytest.raises(AlignmentError, match="build it with"):
        align(tr, _sampler("minite_nvfp4", cfg))


def test_mismatched_exceptions_in_the_pair_are_refused(trainer, cfg):
    from minite.engines.sampler import Sampler
    arm = load_arm("minite_nvfp4").override({"sampler.high_precision": ["embed_tokens", "lm_head"],
                                             "trainer.high_precision": ["embed_tokens", "lm_head"]}, name="hp_off")
    with pytest.raises(AlignmentError, match="different high-precision sets"):
        align(trainer, Sampler(arm, cfg, max_batch=4, max_seq_len=32))
