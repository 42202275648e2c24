"""RL profile configs and the single-writer lock (fast, no engines)."""
import os

import pytest

from minite.rl.checkpoints import single_writer, truncate_jsonl
from minite.rl.config import DEFAULTS, RLConfigError, load_rl_config


@pytest.mark.parametrize("profile", ["cpu", "h200", "b300", "drift"])
def test_profiles_load(profile):
    cfg = load_rl_config(profile)
    assert cfg["rl"]["tis_cap"] is None and cfg["rl"]["beta"] == 0.0   # no IS correction by default
    assert set(cfg) - {"_source"} == set(DEFAULTS)


def test_schema_defaults_fill_what_a_profile_leaves_out(tmp_path):
    p = tmp_path / "partial.yaml"
    p.write_text("")
    cfg = load_rl_config(str(p))
    assert cfg.pop("_source") == str(p) and cfg == DEFAULTS
    assert DEFAULTS["task"]["kind"] == "arithmetic" and DEFAULTS["rl"]["group_size"] == 4
    p.write_text("task: {digits: 3}\nrl: {lr: 1.0e-5}\n")
    cfg = load_rl_config(str(p), {"eval.k": 2})
    assert cfg["task"] == {**DEFAULTS["task"], "digits": 3} and cfg["rl"] == {**DEFAULTS["rl"], "lr": 1e-5}
    assert cfg["eval"] == {**DEFAULTS["eval"], "k": 2}
    math = load_rl_config("b300")["task"]  # a math task takes none of the arithmetic task's defaults
    assert math["kind"] == "math" and "digits" not in math and "ops" not in math
    p.write_text("task: {kind: math, path: x.jsonl, digits: 2}\n")
    with pytest.raises(RLConfigError, match=r"partial.yaml: task.digits: unknown field"):
        load_rl_config(str(p))
    with pytest.raises(RLConfigError, match=r"cpu.yaml \+ overrides \['eval.k'\]: eval.k: 0 is less than"):
        load_rl_config("cpu", {"eval.k": 0})


def test_bad_configs(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("rl: {lr: 1e-4, lrr: 1}\n")
    with pytest.raises(RLConfigError, match="rl.lrr"):
        load_rl_config(str(p))
    p.write_text("rll: {}\n")
    with pytest.raises(RLConfigError, match="rll: unknown field"):
        load_rl_config(str(p))
    with pytest.raises(RLConfigError, match="group_size"):
        load_rl_config("cpu", {"rl.group_size": 1})
    with pytest.raises(RLConfigError, match="tis_cap"):
        load_rl_config("cpu", {"rl.tis_cap": -1})
    with pytest.raises(RLConfigError, match="not found"):
        load_rl_config("nope")
    assert load_rl_config("cpu", {"rl.tis_cap": 2.0})["rl"]["tis_cap"] == 2.0


def test_single_writer_lock(tmp_path):
    with single_writer(tmp_path):
        with pytest.raises(RuntimeError, match="another process"):
            with single_writer(tmp_path):
                pass
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("999999999")            # left by a killed process
    with single_writer(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())


def test_truncate_jsonl_drops_later_and_torn_lines(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "tor')
    truncate_jsonl(p, 2)
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    p.write_text('{"step": 1}\n{"step": 2, "tor')
    truncate_jsonl(p, 5)
    assert p.read_text() == '{"step": 1}\n'
