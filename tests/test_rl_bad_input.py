"""Bad input and resume edge cases of the RL jobs (tiny model, CPU): resume from another working directory,
corrupt or truncated files named in one line, sequences past the model's positions, eval against another task
/ seed / missing steps, a vocabulary too small for the task, and no half-made run directory left behind."""
import json
import shutil

import pytest

# the small RL settings, the one-thread fixture (module-scoped, autouse) and the simulated kill of those tests
from test_rl_loop import SMALL, SimulatedKill, one_thread  # noqa: F401

from minite import distributed as D
from minite.engines.arms import load_arm
from minite.engines.models import load_model_config
from minite.rl import stability
from minite.rl.checkpoints import checkpoints
from minite.rl.config import load_rl_config
from minite.rl.evaluate import evaluate_run
from minite.rl.spec import RunSpec
from minite.rl.stability import is_timing_key, run_stability
from minite.tasks import TaskError, build_task, task_for_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The SFT warm start (outside the repository: a tmp dir) and a finished 2-step run, checkpoints 1 and 2."""
    from minite.rl.sft import run_sft
    cfg = load_rl_config("cpu", SMALL)
    task = build_task(cfg["task"], seed=0)
    model = load_model_config("tiny")
    sft_dir = tmp_path_factory.mktemp("sft").resolve()
    run_sft(model, cfg, task, sft_dir, progress=False)
    spec = RunSpec(load_arm("bf16"), model, cfg, task, init=sft_dir)
    run = tmp_path_factory.mktemp("base") / "run"
    run_stability(spec, run, 2, ckpt_every=1, progress=False)
    return spec, sft_dir, run


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _curve(run):
    return [{k: v for k, v in json.loads(line).items() if not is_timing_key(k)}
            for line in (run / "stability.jsonl").read_text().splitlines()]


def test_resume_from_another_working_directory(setup, tmp_path, monkeypatch):
    spec, sft_dir, base = setup
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "c").mkdir(parents=True)      # another depth: another path relative to it
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path / "a")
    with monkeypatch.context() as m, pytest.raises(SimulatedKill):
        m.setattr(stability, "_after_step", lambda s: (_ for _ in ()).throw(SimulatedKill()) if s == 2 else None)
        run_stability(spec, run, 2, ckpt_every=1, progress=False)
    assert json.loads((run / "run.json").read_text())["init"] == sft_dir.as_posix()    # absolute: cwd-free
    monkeypatch.chdir(tmp_path / "b" / "c")
    run_stability(spec, run, 2, ckpt_every=1, progress=False)                         # the same run
    assert _curve(run) == _curve(base)
    # eval finds the warm start run.json names from this working directory too (step 0)
    spec0 = RunSpec(spec.arm, spec.model_cfg, spec.cfg, spec.task)
    assert evaluate_run(spec0, run, tmp_path / "e.csv", steps=[0], progress=False)["step"].tolist() == [0]


def test_extension_drops_the_old_summary_and_fewer_steps_are_refused(setup, tmp_path, monkeypatch):
    spec, _, base = setup
    run = _copy(base, tmp_path / "run")
    assert (run / "stability_summary.json").is_file()
    with monkeypatch.context() as m, pytest.raises(SimulatedKill):
        m.setattr(stability, "_after_step", lambda s: (_ for _ in ()).throw(SimulatedKill()))
        run_stability(spec, run, 4, ckpt_every=1, progress=False)
    assert not (run / "stability_summary.json").exists()     # it said 2 steps; the log now runs to 3
    assert len(_curve(run)) == 3
    run2 = _copy(base, tmp_path / "run2")
    with pytest.raises(ValueError, match="already holds 2 steps; --steps 1 cannot shorten a run"):
        run_stability(spec, run2, 1, ckpt_every=1, progress=False)
    assert (run2 / "stability_summary.json").is_file() and len(_curve(run2)) == 2     # left as it was


def test_corrupt_files_are_named(setup, tmp_path):
    spec, sft_dir, base = setup
    run = _copy(base, tmp_path / "run_json")
    (run / "run.json").write_text("{\n")
    with pytest.raises(ValueError, match=r"run\.json: corrupt JSON.*new --out"):
        run_stability(spec, run, 3, progress=False)
    with pytest.raises(ValueError, match=r"run\.json: corrupt JSON"):
        evaluate_run(spec, run, tmp_path / "e.csv", progress=False)
    run = _copy(base, tmp_path / "loop_state")
    (checkpoints(run)[-1][1] / "loop_state.json").write_text('{"step": 2,')
    with pytest.raises(ValueError, match=r"step_000002/loop_state\.json: corrupt JSON.*resume from step 1"):
        run_stability(spec, run, 3, progress=False)
    run = _copy(base, tmp_path / "trainer")
    trainer = checkpoints(run)[-1][1] / "trainer"
    trainer.write_bytes(trainer.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step_000002/trainer is unreadable.*delete .*step_000002 to resume from "
                                         r"step 1"):
        run_stability(spec, run, 3, progress=False)
    with pytest.raises(ValueError, match=r"step_000002/trainer is unreadable"):
        evaluate_run(spec, run, tmp_path / "e.csv", progress=False)
    assert not (tmp_path / "e.csv").exists()
    sft = _copy(sft_dir, tmp_path / "sft")
    weights = next((sft / "weights").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    bad = RunSpec(spec.arm, spec.model_cfg, spec.cfg, spec.task, init=sft)
    with pytest.raises(ValueError, match=r"model.*\.safetensors: unreadable safetensors file"):
        run_stability(bad, tmp_path / "r", 1, progress=False)
    assert not (tmp_path / "r").exists()
    (sft / "sft.json").write_text("")
    with pytest.raises(ValueError, match=r"sft\.json: corrupt JSON"):
        run_stability(bad, tmp_path / "r", 1, progress=False)
    from minite.rl.sft import run_sft
    with pytest.raises(ValueError, match=r"sft\.json: corrupt JSON.*--force"):
        run_sft(spec.model_cfg, spec.cfg, spec.task, sft, progress=False)


def test_sequences_past_the_model_positions_are_refused(setup, tmp_path):
    spec, sft_dir, base = setup
    long = RunSpec(spec.arm, spec.model_cfg, load_rl_config("cpu", {**SMALL, "rl.max_new_tokens": 200}), spec.task,
                   init=sft_dir)
    with pytest.raises(ValueError, match=r"task\.max_prompt_len \(\d+\) \+ rl\.max_new_tokens \(200\).*"
                                         r"max_position_embeddings 128"):
        run_stability(long, tmp_path / "r", 1, progress=False)
    assert not (tmp_path / "r").exists()
    ev = RunSpec(spec.arm, spec.model_cfg, load_rl_config("cpu", {**SMALL, "eval.max_new_tokens": 200}), spec.task)
    with pytest.raises(ValueError, match=r"eval\.max_new_tokens \(200\)"):
        evaluate_run(ev, base, tmp_path / "e.csv", progress=False)
    assert not (tmp_path / "e.csv").exists()
    from minite.rl.sft import run_sft
    short = {**spec.model_cfg, "max_position_embeddings": 8}
    with pytest.raises(ValueError, match=r"SFT sequence width.*max_position_embeddings 8"):
        run_sft(short, spec.cfg, spec.task, tmp_path / "sft", progress=False)
    assert not (tmp_path / "sft").exists()


def test_eval_refuses_another_task_seed_or_missing_steps(setup, tmp_path):
    spec, _, base = setup
    csv = tmp_path / "e.csv"
    other_seed = RunSpec(spec.arm, spec.model_cfg, spec.cfg, build_task(spec.cfg["task"], seed=5), seed=5)
    with pytest.raises(ValueError, match=r"the run used seed 0.*use --seed 0"):
        evaluate_run(other_seed, base, csv, progress=False)
    cfg3 = load_rl_config("cpu", {**SMALL, "task.digits": 3})
    with pytest.raises(ValueError, match=r"task\.digits: run 2, here 3"):
        evaluate_run(RunSpec(spec.arm, spec.model_cfg, cfg3, build_task(cfg3["task"])), base, csv, progress=False)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step\(s\) \[99\]; it has steps \[0, 1, 2\]"):
        evaluate_run(spec, base, csv, steps=[1, 99], progress=False)
    assert not csv.exists()


def test_vocab_too_small_and_no_half_made_run(setup, tmp_path, monkeypatch, caplog):
    spec, sft_dir, _ = setup
    small_vocab = {**spec.model_cfg, "vocab_size": 16}
    with pytest.raises(TaskError, match=r"vocab_size 16 < the 32 ids of the char tokenizer"):
        task_for_model(spec.cfg["task"], small_vocab)
    with pytest.raises(TaskError, match="vocab_size 16"):
        task_for_model(None, small_vocab)
    import yaml
    model_yaml = tmp_path / "m.yaml"
    model_yaml.write_text(yaml.safe_dump({**spec.model_cfg, "name": "m", "vocab_size": 16}))
    from minite.cli import main
    assert main(["rl", "--arm", "bf16", "--model", str(model_yaml), "--steps", "1", "--out", str(tmp_path / "v"),
                 "--no-progress"]) == 2
    assert "vocab_size 16" in caplog.text and not (tmp_path / "v").exists()
    # a failure in a step before the first checkpoint leaves no run.json / segments.jsonl behind
    with monkeypatch.context() as m, pytest.raises(SimulatedKill):
        m.setattr(stability, "_after_step", lambda s: (_ for _ in ()).throw(SimulatedKill()))
        run_stability(spec, tmp_path / "k", 2, ckpt_every=2, progress=False)
    assert not (tmp_path / "k").exists()
    # ... but a directory it did not create keeps whatever was there
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with monkeypatch.context() as m, pytest.raises(SimulatedKill):
        m.setattr(stability, "_after_step", lambda s: (_ for _ in ()).throw(SimulatedKill()))
        run_stability(spec, tmp_path / "keep", 2, ckpt_every=2, progress=False)
    assert (tmp_path / "keep" / "notes.txt").is_file()


def test_only_rank0_creates_the_run_directory(setup, tmp_path, monkeypatch):
    spec, _, _ = setup
    monkeypatch.setattr(D, "is_main", lambda: False)       # another rank under torchrun

    def fail(*a, **k):
        raise RuntimeError("3 rollout rows do not split evenly over 2 ranks")
    monkeypatch.setattr(stability, "_run", fail)
    with pytest.raises(RuntimeError, match="split evenly"):
        run_stability(spec, tmp_path / "r", 1, progress=False)
    assert not (tmp_path / "r").exists()
