"""RL profile configs (configs/rl/<profile>.yaml): task, SFT warm start, GRPO, checkpoints, drift alarm, evals.

The schema configs/schemas/rl.schema.yaml holds every key, its type and range, and its default; a profile
YAML gives any subset. Unknown sections or keys, and values out of range, raise ``RLConfigError`` naming the
file and the key (a typo must not silently fall back to a default).

An arm may fix RL settings of its own (its YAML's ``rl:`` block, ``Arm.rl``: only ``tis_cap``, how the learner
corrects for the engine mismatch). ``with_arm_settings(cfg, arm)`` applies them on top of the profile: every
other setting stays the profile's, the same for every arm. A profile (or ``--set``) that sets such a key to
another value than the arm is refused rather than silently overridden.
"""
from __future__ import annotations

import copy
import hashlib
import json

from minite.yamlconfig import defaults, load_yaml, validate

#: the full key set with the schema's defaults (what an empty profile loads as)
DEFAULTS: dict = defaults("rl")


class RLConfigError(ValueError):
    """A malformed RL profile config."""


def load_rl_config(profile_or_path: str = "cpu", overrides: dict | None = None) -> dict:
    """Schema defaults <- YAML <- overrides ({"rl.lr": 1e-5, ...}), validated; returns a new dict with
    ``_source`` (the YAML file)."""
    raw, path = load_yaml("rl", profile_or_path, RLConfigError)
    raw, source = copy.deepcopy(raw), path
    if overrides:
        source = f"{path} + overrides {sorted(overrides)}"
        for dotted, value in overrides.items():
            section, dot, key = dotted.partition(".")
            if not dot or not key:
                raise RLConfigError(f"override {dotted!r}: expected SECTION.KEY (e.g. rl.lr)")
            body = raw.setdefault(section, {})
            if not isinstance(body, dict):
                raise RLConfigError(f"RL config {path}: {section}: expected a mapping, got {body!r}")
            body[key] = value
    cfg = validate(raw, "rl", source, RLConfigError, fill_defaults=True)
    cfg["_source"] = path
    return cfg


def with_arm_settings(cfg: dict, arm) -> dict:
    """``cfg`` with the arm's own RL settings (``arm.rl``) applied, re-validated; ``cfg`` itself when the arm has
    none. ``_arm_rl`` records what the arm set (run.json keeps the config). Applying it twice is a no-op."""
    fixed = getattr(arm, "rl", None) or {}
    if not fixed:
        return cfg
    out = copy.deepcopy(cfg)
    for key, value in fixed.items():
        have, default = out["rl"].get(key), DEFAULTS["rl"].get(key)
        if have not in (default, value):
            raise RLConfigError(f"arm {arm.name} sets rl.{key}={value!r}, the RL config {cfg.get('_source')} "
                                f"sets {have!r}: an arm's own RL settings are not overridden; leave rl.{key} "
                                "at its default in the config")
        out["rl"][key] = value
    source = f"{cfg.get('_source')} + arm {arm.name} rl {fixed}"
    out = validate({k: v for k, v in out.items() if not k.startswith("_")}, "rl", source, RLConfigError,
                   fill_defaults=True)
    out["_source"] = cfg.get("_source")
    out["_arm_rl"] = dict(fixed)
    return out


def config_hash(obj) -> str:
    """Stable short hash of a JSON-able object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
