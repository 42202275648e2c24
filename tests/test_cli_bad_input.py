"""Bad input to the command-line jobs: exit 2 with one line naming the flag (or path), before any work, and
nothing left behind; valid input unchanged (an SFT directory for bench-sampler, kernel-bench's dry-run output)."""
import argparse
import importlib
import json
import logging
import os

import pytest

from minite.cli import JOBS, build_parser, main
from minite.jobs import common
from minite.provenance import REPO_ROOT


def _error(caplog) -> str:
    """The one error line a refused job logged (no traceback attached)."""
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    msg = errors[0].getMessage()
    assert "\n" not in msg
    return msg


@pytest.fixture
def no_work(monkeypatch):
    """Make ``job``'s run() fail the test if it is reached: the refusal must come before any work."""
    def forbid(job):
        def run(args):
            raise AssertionError(f"{job}.run reached")
        monkeypatch.setattr(importlib.import_module(f"minite.jobs.{JOBS[job][0]}"), "run", run)
    return forbid


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# a valid command of each job but for its --out
ARGV = {
    "rl": ["rl", "--arm", "bf16", "--steps", "1"],
    "sft": ["sft"],
    "eval": ["eval", "--arm", "bf16", "--run-dir", "run"],
    "diagnose": ["diagnose", "--arm", "bf16"],
    "bench-learner": ["bench-learner", "--arm", "bf16"],
    "bench-sampler": ["bench-sampler", "--arm", "bf16"],
    "export-modelopt": ["export-modelopt"],
    "kernel-bench": ["kernel-bench", "--dry-run"],
}
FILE_JOBS = ["eval", "bench-learner", "bench-sampler", "kernel-bench"]
DIR_JOBS = ["rl", "sft", "diagnose", "export-modelopt"]


@pytest.mark.parametrize("job,out,msg", [
    *[(j, "adir", "is a directory, expected a file") for j in FILE_JOBS],
    *[(j, "afile", "is a file, expected a directory") for j in DIR_JOBS],
    *[(j, "afile/x", "afile is a file, not a directory") for j in JOBS],
])
def test_out_of_the_wrong_kind_is_refused_before_any_work(job, out, msg, tmp_path, caplog, no_work):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    before = _listing(tmp_path)
    no_work(job)
    assert main([*ARGV[job], "--out", str(tmp_path / out)]) == 2
    err = _error(caplog)
    assert f"--out {tmp_path / out}" in err and msg in err
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("job", ["bench-learner", "rl"])
def test_unwritable_out_is_refused_before_any_work(job, tmp_path, caplog, monkeypatch, no_work):
    """Root writes anywhere os.access says no, so the check really tries to create a file; here that
    attempt fails the way an immutable or read-only directory makes it fail."""
    import tempfile
    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):
        if dir is not None and os.path.samefile(dir, locked):
            raise PermissionError(1, "Operation not permitted")
        return real(*a, dir=dir, **k)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    no_work(job)
    assert main([*ARGV[job], "--out", str(locked / "sub" / "x.json")]) == 2
    assert f"cannot write in {locked} (Operation not permitted)" in _error(caplog)
    assert _listing(tmp_path) == ["locked"]


@pytest.mark.parametrize("job", ["bench-learner", "bench-sampler"])
def test_torch_profile_is_checked_before_any_work(job, tmp_path, caplog, no_work):
    (tmp_path / "afile").write_text("x")
    no_work(job)
    assert main([*ARGV[job], "--torch-profile", str(tmp_path / "afile" / "p.csv"),
                 "--out", str(tmp_path / "b.json")]) == 2
    assert "--torch-profile" in _error(caplog)


def test_valid_outputs_pass_and_leave_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    (tmp_path / "old.json").write_text("{}")
    for job, out in (("rl", "run"), ("rl", "new/deeper/run"), ("bench-learner", "old.json"),
                     ("eval", "run/evals.csv"), ("bench-sampler", "new/s.json")):
        args = build_parser(load_jobs=job).parse_args([*ARGV[job], "--out", str(tmp_path / out)])
        common.check_outputs(args)
    assert _listing(tmp_path) == ["old.json", "run", "run/run.json"]      # no probe files, no directories


def test_out_under_the_committed_reference_is_refused(tmp_path, caplog, no_work):
    no_work("bench-learner")
    out = REPO_ROOT / "results" / "reference" / "cpu" / "bf16" / "learner.json"
    assert main([*ARGV["bench-learner"], "--out", str(out)]) == 2
    assert "results/reference/" in _error(caplog) and "read-only" in caplog.text


@pytest.mark.parametrize("job,marker", [("rl", "sft.json"), ("rl", "mismatch.json"), ("export-modelopt", "run.json"),
                                        ("diagnose", "run.json"), ("export-modelopt", "mismatch.json"),
                                        ("sft", "run.json")])
def test_directory_of_another_job_is_refused(job, marker, tmp_path, caplog, no_work):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / marker).write_text("{}")
    no_work(job)
    assert main([*ARGV[job], "--out", str(tmp_path / "other")]) == 2
    assert f"holds {marker}" in _error(caplog)
    assert _listing(tmp_path) == ["other", f"other/{marker}"]


def test_eval_does_not_write_over_a_run_marker(tmp_path, caplog, no_work):
    no_work("eval")
    (tmp_path / "run.json").write_text("{}")
    assert main([*ARGV["eval"], "--out", str(tmp_path / "run.json")]) == 2
    assert "run.json is the marker" in _error(caplog)
    assert (tmp_path / "run.json").read_text() == "{}"


def test_every_job_declares_its_output():
    """Each job says whether --out is a file or a directory, and refuses only markers some job declares."""
    declared = {}
    for job in JOBS:
        d = build_parser(load_jobs=job).parse_args([*ARGV[job], "--out", "x"])
        declared[job] = (d._out_kind, d._out_marker, d._out_refuses)
    assert {j for j, (kind, *_) in declared.items() if kind == "dir"} == set(DIR_JOBS)
    markers = {m for _, m, _ in declared.values() if m}
    assert markers == {"run.json", "sft.json", "mismatch.json", "export_provenance.json"}
    for job, (_, marker, refuses) in declared.items():
        assert set(refuses) <= markers and marker not in refuses, job


# --------------------------------------------------------------------------------------------- flag values
@pytest.mark.parametrize("flag,value,least", [("--micro-batch-size", "-1", 1), ("--micro-batch-size", "0", 1),
                                              ("--seq-len", "0", 2), ("--seq-len", "1", 2),
                                              ("--tokens-per-update", "0", 1), ("--tokens-per-update", "-64", 1)])
def test_bench_learner_refuses_nonpositive_sizes(flag, value, least, tmp_path, capsys):
    out = tmp_path / "l.json"
    assert main(["bench-learner", "--arm", "bf16", "--model", "tiny", "--device", "cpu", "--steps", "1",
                 "--warmup", "0", "--split-steps", "0", flag, value, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench-learner: error: {flag} must be >= {least}, got {value}"]
    assert not out.exists()


@pytest.mark.parametrize("argv,flag", [
    (["bench-learner", "--arm", "bf16", "--device", "gpu"], "--device 'gpu'"),
    (["bench-sampler", "--arm", "bf16", "--device", "mps"], "--device 'mps'"),
    (["diagnose", "--arm", "bf16", "--device", "cuda:x"], "--device 'cuda:x'"),
])
def test_unknown_device_is_one_line(argv, flag, tmp_path, capsys, caplog, monkeypatch):
    import minite.diagnostics.run as R
    monkeypatch.setattr(R, "diagnose_arm", lambda *a, **k: pytest.fail("diagnosis ran"))
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = caplog.text + capsys.readouterr().err
    assert f"{flag}: expected cpu, cuda or cuda:N" in err
    assert not (tmp_path / "o").exists()


def test_malformed_set_yaml_is_one_line(tmp_path, caplog):
    assert main(["rl", "--arm", "bf16", "--steps", "1", "--set", "rl.lr=[1,", "--out", str(tmp_path / "r")]) == 2
    assert "--set 'rl.lr=[1,': the value is not valid YAML" in _error(caplog)
    assert not (tmp_path / "r").exists()


def test_export_modelopt_refuses_no_calibration_prompts_before_the_engines(tmp_path, caplog, monkeypatch):
    import minite.engines.sampler as S
    monkeypatch.setattr(S, "Sampler", lambda *a, **k: pytest.fail("engines built"))
    assert main(["export-modelopt", "--calib-prompts", "0", "--out", str(tmp_path / "ex")]) == 2
    assert "--calib-prompts must be >= 1, got 0" in _error(caplog)


def test_kernel_bench_rep_must_be_positive(tmp_path, caplog):
    assert main(["kernel-bench", "--dry-run", "--rep", "0", "--out", str(tmp_path / "k.csv")]) == 2
    assert "--rep must be > 0" in _error(caplog)
    assert not (tmp_path / "k.csv").exists()


def test_kernel_bench_dry_run_default_out_is_not_the_h200_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["kernel-bench", "--dry-run"]) == 0
    assert _listing(tmp_path / "results") == ["dry-run", "dry-run/kernels.csv", "dry-run/kernels.md"]
    p = argparse.ArgumentParser()
    from minite.kernels import bench
    bench.add_args(p)
    assert bench.default_out(p.parse_args([])) == "results/h200/kernels.csv"   # real runs: as the pipeline reads


# ------------------------------------------------------------------------------------------------- diagnose
@pytest.fixture
def no_diagnosis(monkeypatch):
    import minite.diagnostics.run as R
    monkeypatch.setattr(R, "diagnose_arm", lambda *a, **k: pytest.fail("diagnosis ran before the check"))
    monkeypatch.setattr(R, "attribution_table", lambda *a, **k: pytest.fail("attribution ran before the check"))


@pytest.mark.parametrize("extra,msg", [
    (["--attribution-base", "bf16"], "--attribution-base bf16: not a naive NVFP4 arm"),
    (["--attribution-base", "minite_nvfp4"], "--attribution-base minite_nvfp4: not a naive NVFP4 arm"),
    (["--attribution-base", "nope"], "--attribution-base: unknown arm 'nope'"),
    (["--attribution", "off", "--attribution-from", "x"], "--attribution-from reuses an attribution"),
    (["--attribution-from", "{tmp}/none"], "--attribution-from {tmp}/none: cannot read its attribution"),
    (["--max-new-tokens", "100000"], "--max-new-tokens (100000)"),
])
def test_diagnose_checks_its_flags_before_the_diagnosis(extra, msg, tmp_path, caplog, no_diagnosis):
    extra = [e.format(tmp=tmp_path) for e in extra]
    assert main(["diagnose", "--arm", "minite_nvfp4", "--device", "cpu", *extra, "--out", str(tmp_path / "d")]) == 2
    err = _error(caplog)
    assert msg.format(tmp=tmp_path) in err
    if "naive NVFP4" in msg:   # the arms that qualify, from the arm configs
        assert "naive_te_nvfp4, naive_te_nvfp4_blanket" in err and "bf16," not in err
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------------------------------- valid input
@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """An SFT directory as ``python -m minite sft`` leaves it: sft.json naming weights/, a local HF checkpoint."""
    from minite.engines.models import build_hf_config, build_hf_model, load_model_config
    d = tmp_path_factory.mktemp("sft")
    cfg = load_model_config("tiny")
    build_hf_model(cfg, build_hf_config(cfg), seed=3).save_pretrained(d / "weights")
    (d / "sft.json").write_text(json.dumps({"weights": "weights", "model": "tiny"}))
    return d


def test_bench_sampler_takes_an_sft_directory(sft_dir, tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench-sampler", "--arm", "bf16", "--model", "tiny", "--device", "cpu", "--batch", "2",
                 "--prompt-len", "4", "--new-tokens", "3", "--checkpoint", str(sft_dir), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["weights"] == f"checkpoint {sft_dir}"


# ------------------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("job,resume", [("rl", True), ("sft", False), ("bench-learner", False)])
def test_ctrl_c_is_one_line_and_exit_130(job, resume, tmp_path, caplog, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module(f"minite.jobs.{JOBS[job][0]}"), "run", interrupted)
    out = tmp_path / ("x.json" if job in FILE_JOBS else "x")
    try:
        assert main([*ARGV[job], "--out", str(out)]) == 130
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main")
    err = _error(caplog)
    assert err.startswith(f"{job}: interrupted") and ("rerun the same command to resume" in err) == resume
