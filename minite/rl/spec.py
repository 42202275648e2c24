"""What one RL run is (``RunSpec``) and how its engines start: every arm from the same warm start.

The warm start is the bf16 SFT checkpoint (``minite.rl.sft``) or any local HF checkpoint. Both engines of
the arm load it (``minite.engines.build_engines``); a sampler with static activation scales is then
calibrated ONCE on the task's calibration prompts (the same on resume, so a resumed run has the same scales
as the uninterrupted one).

Paths written into results (``stored_path``) are relative to the repository when inside it, so results
do not hold the machine's checkout location; outside it they are absolute, since a path relative to the working
directory would read back wrong from another one and, in the run id, make a resume from there "another run".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minite import distributed as D
from minite.engines import build_engines
from minite.engines.arms import Arm
from minite.provenance import read_json
from minite.rl.config import config_hash, with_arm_settings
from minite.tasks import Task

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunSpec:
    """One run's identity: the arm, model, RL config and task, the warm start, the seed and the device."""

    arm: Arm | None           # None for the arm-less SFT warm start
    model_cfg: dict
    cfg: dict                 # the RL config (minite.rl.config)
    task: Task
    init: str | Path | None = None
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        # the arm's own RL settings (its `rl:` block: tis_cap) on top of the profile, for every user of the spec
        if self.arm is not None:
            object.__setattr__(self, "cfg", with_arm_settings(self.cfg, self.arm))

    @property
    def init_path(self) -> str | None:
        """The warm start as stored in results and hashed into the run id (``stored_path``), None without one."""
        return stored_path(self.init) if self.init else None

    def run_id(self) -> str:
        """Hash of everything that changes the curve (not the checkpoint cadence, evals, the measurements
        beside the curve (``metrics``) or file locations; the number of processes when above one)."""
        cfg = {k: v for k, v in self.cfg.items() if k not in ("ckpt", "eval", "metrics", "_source")}
        key = {"arm": self.arm.raw or self.arm.name, "model": self.model_cfg, "cfg": cfg,
               "task": self.task.config(), "seed": self.seed, "init": self.init_path}
        if D.world_size() > 1:        # each process samples its own stream: the curve depends on their number
            key["world_size"] = D.world_size()
        return config_hash(key)

    def engines(self, max_batch: int, max_seq_len: int):
        """(trainer, sampler) holding the warm-start weights, the sampler calibrated when the arm needs it."""
        rl = self.cfg["rl"]
        calib = (self.task.calibration_prompts(rl["prompts_per_step"] * rl["group_size"])
                 if self.arm.needs_calibration else None)
        return build_engines(self.arm, self.model_cfg, device=self.device, seed=self.seed,
                             checkpoint=warm_start_weights(self.init), calibration_prompts=calib,
                             max_batch=max_batch, max_seq_len=max_seq_len, lr=rl["lr"],
                             micro_batch_size=rl["micro_batch_size"])

    def reference(self):
        """A frozen copy of the warm start on the arm's trainer: the KL reference (rl.beta > 0)."""
        from minite.engines.trainer import Trainer
        return Trainer(self.arm, self.model_cfg, device=self.device, seed=self.seed,
                       checkpoint=warm_start_weights(self.init))


def init_weights_path(init: str | Path) -> Path | None:
    """The weights of a warm start: an SFT directory (``minite.rl.sft``) or a checkpoint directory as is.
    None when the SFT directory recorded no weights (``sft.steps: 0``: the model config's own checkpoint)."""
    p = Path(init)
    if (p / "sft.json").is_file():
        if read_json(p / "sft.json", "rerun `python -m minite sft --force` to rewrite it").get("weights") is None:
            return None
        p = p / "weights"
    if not p.exists():
        raise FileNotFoundError(f"warm-start checkpoint {str(p)!r} does not exist (run `python -m minite sft`)")
    return p


def warm_start_weights(init) -> str | None:
    """``init_weights_path`` as the engines take it (None: the model config's checkpoint or a seeded init),
    its files checked first (``check_weights``)."""
    p = init_weights_path(init) if init else None
    if p is not None:
        check_weights(p)
    return str(p) if p is not None else None


def check_weights(ckpt: Path) -> None:
    """A one-line error naming the file for a truncated or corrupt config.json / safetensors file of a warm
    start, before the engines load it (transformers' own error is a traceback naming no file). Reads only the
    headers: safetensors checks that they cover the whole file, so a cut-short copy is caught here."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return                      # the engines explain what a checkpoint directory needs
    fix = "copy the checkpoint again (or rerun `python -m minite sft --force`)"
    if (ckpt / "config.json").is_file():
        read_json(ckpt / "config.json", fix)
    from safetensors import safe_open
    for f in sorted(ckpt.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception as e:      # SafetensorError (a Rust exception type), OSError
            raise ValueError(f"{f}: unreadable safetensors file ({e}); {fix}") from None


def stored_path(path: str | Path) -> str:
    """``path`` as results store it: relative to the repository when inside it, else absolute (resolved), so it
    reads back, and hashes, the same from any working directory."""
    p = Path(path).resolve()
    if p.is_relative_to(REPO_ROOT):
        return p.relative_to(REPO_ROOT).as_posix()
    return p.as_posix()


def resolve_stored_path(path: str | Path) -> Path:
    """A path read back from results: an absolute one as is, a relative one against the repository when it
    exists there, else from the working directory (results written before outside paths were stored absolute
    held them relative to the job's working directory)."""
    p = Path(path)
    if not p.is_absolute() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p
