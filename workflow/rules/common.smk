# Config loading and helpers shared by every rule file.
#
# The profile is chosen by the config: `profile` from --configfile / --config (default "cpu"). Its
# workflow/profiles/<profile>/pipeline.yaml is the base; whatever --configfile / --config set is merged on
# top (so `--config arms=[bf16]` overrides the profile's arms), then the result is validated.
#
# Paths are relative to the repository (the working directory is pinned to it below), so nothing an output
# records names the machine it ran on. A run writes results/<profile>/ (git-ignored); the committed
# reference runs in results/reference/<profile>/ are read, never written.
import mimetypes
import re
import shlex
import sys
from pathlib import Path

import yaml
from snakemake.utils import update_config, validate

REPO = Path(workflow.basedir)
REFERENCE_ROOT = "results/reference"
mimetypes.add_type("application/x-ipynb+json", ".ipynb")  # executed notebooks in the --report


def _coerce(value):
    """--config values arrive as strings (nested ones too): turn '50' / 'true' / 'null' into YAML scalars."""
    if isinstance(value, dict):
        return {k: _coerce(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_coerce(v) for v in value]
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return parsed if isinstance(parsed, (int, float, bool, type(None))) else value
    return value


def _load_config(given: dict) -> dict:
    profile = str(given.get("profile", "cpu"))
    path = REPO / "workflow" / "profiles" / profile / "pipeline.yaml"
    if not path.is_file():
        known = sorted(p.parent.name for p in (REPO / "workflow" / "profiles").glob("*/pipeline.yaml"))
        raise WorkflowError(f"unknown profile {profile!r}: no {path} (profiles: {', '.join(known)})")
    merged = yaml.safe_load(path.read_text())
    given = _coerce(dict(given))
    if isinstance(given.get("arms"), str):  # --config arms=bf16 or arms=bf16,minite_nvfp4
        given["arms"] = [a for a in given["arms"].split(",") if a]
    update_config(merged, given)
    return merged


_merged = _load_config(config)
config.clear()
config.update(_merged)
validate(config, "../schemas/config.schema.yaml")

PROFILE = config["profile"]
RESULTS = config.get("results") or f"results/{PROFILE}"
if Path(RESULTS).resolve().is_relative_to((REPO / REFERENCE_ROOT).resolve()):
    raise WorkflowError(f"results={RESULTS!r}: {REFERENCE_ROOT}/ holds the committed reference runs and is "
                        "read-only to the pipeline; write a run elsewhere (default results/<profile>)")
# The committed reference run of this profile, shown beside a new run where a table or notebook can.
REFERENCE = f"{REFERENCE_ROOT}/{PROFILE}"
ARMS = list(config["arms"])
# The interpreter stays out of rule params on purpose: a different venv path must not rerun every job.
PY = config["python"] or sys.executable
FIGS = f"{RESULTS}/figures"
LOGS = f"{RESULTS}/logs"

_missing = [a for a in ARMS if not (REPO / "configs" / "arms" / f"{a}.yaml").is_file()]
if _missing:
    _known = sorted(p.stem for p in (REPO / "configs" / "arms").glob("*.yaml"))
    raise WorkflowError(f"unknown arm(s) {_missing} in config 'arms' (configs/arms/ has: {', '.join(_known)})")


def _check_configs():
    """Every configured arm and model YAML checked now, as the jobs will load them: a broken one fails here,
    not in the first job that reads it after hours of the jobs before it. Where this interpreter has no minite
    (snakemake installed apart from it), the jobs still check them."""
    try:
        from minite.engines.arms import load_arm
        from minite.engines.models import load_model_config
    except ImportError:
        return
    for a in ARMS:
        try:
            load_arm(REPO / "configs" / "arms" / f"{a}.yaml")
        except ValueError as e:
            raise WorkflowError(f"config 'arms': {e}") from None
    for name, j in config["jobs"].items():
        model = j.get("model")
        if model:
            p = REPO / "configs" / "models" / f"{model}.yaml"
            try:
                load_model_config(p if p.is_file() else model, num_layers=(j.get("args") or {}).get("layers"))
            except ValueError as e:
                raise WorkflowError(f"config 'jobs.{name}.model': {e}") from None


_check_configs()


wildcard_constraints:
    arm="|".join(re.escape(a) for a in ARMS),


def arm_yaml(wildcards):
    """The arm's YAML: an input of every per-arm rule, so editing one arm reruns only that arm."""
    return f"configs/arms/{wildcards.arm}.yaml"


def job(name: str) -> dict:
    return config["jobs"][name]


def model_inputs(name: str) -> list[str]:
    """The job's model YAML (configs/models/<model>.yaml, or the path given) and its declared extra inputs."""
    j = job(name)
    files = list(j.get("inputs", []))
    model = j.get("model")
    if model:
        p = f"configs/models/{model}.yaml"
        files.append(p if (REPO / p).is_file() else model)
    return files


def render_args(args: dict) -> str:
    """{'steps': 3, 'fast': True, 'skip': None, 'm': [1, 2], 'set': {'rl.lr': 1e-5}} ->
    '--steps 3 --fast --m 1 2 --set rl.lr=1e-05' (shell-quoted): a list is one flag with several values, a
    mapping a repeated KEY=VALUE flag (the RL jobs' --set)."""
    out = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        if isinstance(value, dict):
            out += [f"--{key} " + shlex.quote(f"{k}={v}") for k, v in value.items()]
            continue
        out.append(f"--{key}")
        if value is True:
            continue
        out += [shlex.quote(str(v)) for v in (value if isinstance(value, list) else [value])]
    return " ".join(out)


def job_args(name: str, **override) -> str:
    """The flags of job `name` from the config: --model first (when set), then `args` in order (``override``:
    values that replace some of them, e.g. device="cuda:1")."""
    j = job(name)
    model = f"--model {shlex.quote(j['model'])} " if j.get("model") else ""
    return (model + render_args({**j.get("args", {}), **override})).strip()


def _cores() -> int:
    try:
        return workflow.cores
    except WorkflowError:  # modes without --cores (--report, --lint): threads do not matter there
        return 1


def job_threads(name: str) -> int:
    t = job(name).get("threads", "all")
    return _cores() if t == "all" else min(int(t), _cores())


def job_gpus(name: str) -> int:
    return int(job(name).get("gpu", 0))


def minite(name: str) -> str:
    """The command that runs job `name` (a shell-string prefix; `{PY}` is filled in by Snakemake): `python -m
    minite`, or, when the profile gives the job more than one GPU, the same under torchrun with one process per
    GPU (`python -m torch.distributed.run`: torchrun with the same interpreter)."""
    n = job_gpus(name)
    return "{PY} " + (f"-m torch.distributed.run --standalone --nproc-per-node {n} " if n > 1 else "") + "-m minite"


def per_arm(pattern: str) -> list[str]:
    return expand(pattern, arm=ARMS)
