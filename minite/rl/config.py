"""RL profile configs (configs/rl/<profile>.yaml): task, SFT warm start, GRPO, checkpoints, drift alarm, evals.

``DEFAULTS`` below is the full key set; a profile YAML overrides any subset of it. Unknown sections or keys
raise ``RLConfigError`` naming the file and key (a typo must not silently fall back to a default).
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import yaml

RL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "rl"

DEFAULTS: dict = {
    "task": {"kind": "arithmetic", "digits": 2, "ops": ["+"], "heldout_frac": 0.1, "n_heldout": 128},
    "sft": {"steps": 600, "batch_size": 64, "lr": 5e-3, "eval_prompts": 128, "micro_batch_size": None,
            "compute_dtype": "auto"},
    "rl": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
           "lr": 1e-4, "micro_batch_size": None, "clip_low": 0.2, "clip_high": 0.28, "beta": 0.0,
           "tis_cap": None, "std_normalize": True, "agg": "token-mean", "drift_metric": "k3"},
    "ckpt": {"every": 10, "keep": None},
    "drift": {"warmup": 20, "kappa": 1.0, "h": 8.0, "floor": 1e-12, "sigma_floor": 0.05},
    "collapse": {"alpha": 0.1, "frac": 0.5, "min_peak": 0.05, "warmup": 10},
    "eval": {"k": 4, "n_prompts": 64, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
}
# task blocks differ by kind (math has its own keys), so they are not checked against DEFAULTS here
_FREE_SECTIONS = ("task",)


class RLConfigError(ValueError):
    """A malformed RL profile config."""


def load_rl_config(profile_or_path: str = "cpu", overrides: dict | None = None) -> dict:
    """Merge DEFAULTS <- YAML <- overrides ({"rl.lr": 1e-5, ...}); returns a new dict with ``_source``."""
    p = Path(profile_or_path)
    path = p if p.suffix in (".yaml", ".yml") else RL_CONFIG_DIR / f"{profile_or_path}.yaml"
    if not path.is_file():
        known = sorted(q.stem for q in RL_CONFIG_DIR.glob("*.yaml"))
        raise RLConfigError(f"RL config {str(path)!r} not found (profiles: {known})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RLConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise RLConfigError(f"{path}: top level must be a mapping")
    cfg = copy.deepcopy(DEFAULTS)
    for sec, body in raw.items():
        if sec not in cfg:
            raise RLConfigError(f"{path}: unknown section {sec!r} (known: {sorted(cfg)})")
        if not isinstance(body, dict):
            raise RLConfigError(f"{path}: section {sec!r} must be a mapping")
        if sec in _FREE_SECTIONS:
            cfg[sec] = dict(body) if body.get("kind", "arithmetic") != cfg[sec]["kind"] else {**cfg[sec], **body}
            continue
        for k, v in body.items():
            if k not in cfg[sec]:
                raise RLConfigError(f"{path}: unknown key {sec}.{k} (known: {sorted(cfg[sec])})")
            cfg[sec][k] = v
    for dotted, v in (overrides or {}).items():
        sec, _, key = dotted.partition(".")
        if sec not in cfg or (sec not in _FREE_SECTIONS and key not in cfg[sec]):
            raise RLConfigError(f"unknown override {dotted!r}")
        cfg[sec][key] = v
    _check(cfg, path)
    cfg["_source"] = str(path)
    return cfg


def _check(cfg: dict, path) -> None:
    rl = cfg["rl"]
    if int(rl["group_size"]) < 2:
        raise RLConfigError(f"{path}: rl.group_size must be >= 2 (GRPO needs a group), got {rl['group_size']}")
    if not isinstance(cfg["sft"]["steps"], int) or cfg["sft"]["steps"] < 0:
        raise RLConfigError(f"{path}: sft.steps must be an int >= 0, got {cfg['sft']['steps']!r}")
    for sec, key in (("rl", "prompts_per_step"), ("rl", "max_new_tokens"), ("sft", "batch_size"), ("ckpt", "every"), ("eval", "k"), ("eval", "n_prompts")):
        if not isinstance(cfg[sec][key], int) or cfg[sec][key] < 1:
            raise RLConfigError(f"{path}: {sec}.{key} must be a positive int, got {cfg[sec][key]!r}")
    for sec, key in (("rl", "lr"), ("sft", "lr"), ("rl", "temperature"), ("eval", "temperature")):
        if not isinstance(cfg[sec][key], (int, float)) or not cfg[sec][key] > 0:
            raise RLConfigError(f"{path}: {sec}.{key} must be a positive number, got {cfg[sec][key]!r}")
    if rl["tis_cap"] is not None and not (isinstance(rl["tis_cap"], (int, float)) and rl["tis_cap"] > 0):
        raise RLConfigError(f"{path}: rl.tis_cap must be null or a positive number, got {rl['tis_cap']!r}")


def config_hash(obj) -> str:
    """Stable short hash of a JSON-able object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
