"""The command line: every job's flags parse, the shared flags and their older spellings, one error path."""
import argparse
import logging

import pytest

from minite.cli import JOBS, build_parser, main
from minite.jobs import common


@pytest.mark.parametrize("job", list(JOBS))
def test_every_job_builds_its_parser(job, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(load_jobs=job).parse_args([job, "--help"])
    assert e.value.code == 0
    assert "--out" in capsys.readouterr().out


def _parser(*adders):
    p = argparse.ArgumentParser()
    for add in adders:
        add(p)
    return p


def test_older_spellings_are_accepted_and_hidden(capsys):
    p = _parser(common.add_model, common.add_checkpoint, common.add_rl_config, common.add_device)
    old = p.parse_args(["--num-layers", "1", "--init", "ck", "--profile", "h200"])
    new = p.parse_args(["--layers", "1", "--checkpoint", "ck", "--rl-config", "h200"])
    assert vars(old) == vars(new) == {"model": "tiny", "layers": 1, "checkpoint": "ck", "rl_config": "h200",
                                      "set": [], "device": None}
    defaults = p.parse_args([])
    assert (defaults.layers, defaults.checkpoint, defaults.rl_config) == (None, None, "cpu")
    p.print_help()
    shown = capsys.readouterr().out
    assert "--layers" in shown and "--checkpoint" in shown and "--rl-config" in shown
    assert "--num-layers" not in shown and "--init" not in shown and "--profile" not in shown


def test_rl_config_of(tmp_path):
    p = _parser(lambda q: common.add_rl_config(q, default=None))
    assert common.rl_config_of(p.parse_args([])) is None                  # no config: the job's default task
    cfg = common.rl_config_of(p.parse_args(["--set", "task.digits=3"]))    # overrides alone: on the cpu config
    assert cfg["task"]["digits"] == 3 and cfg["rl"]["group_size"] == 4
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        common.rl_config_of(p.parse_args(["--set", "task.digits"]))


@pytest.mark.parametrize("argv,msg", [
    (["diagnose", "--arm", "fp8"], "unknown arm"),
    (["diagnose", "--arm", "bf16", "--model", "huge"], "huge"),
    (["diagnose", "--arm", "bf16", "--checkpoint", "no/such/dir"], "does not exist"),
    (["diagnose", "--arm", "bf16", "--prompts", "0"], "--prompts must be >= 1"),
    (["diagnose", "--arm", "bf16", "--rl-config", "nope"], "not found"),
    (["sft", "--set", "rl.bogus=1"], "bogus"),
    (["rl", "--arm", "bf16", "--steps", "0"], "--steps must be >= 1"),
])
def test_user_errors_are_one_line_and_exit_2(argv, msg, tmp_path, caplog):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and msg in errors[0].getMessage() and errors[0].exc_info is None
    assert "\n" not in errors[0].getMessage()
    assert not (tmp_path / "out").exists()                                # nothing half-written
