"""The configs minite ships, and the one loader for them.

The YAML files live in the repository's top-level ``configs/`` directory, installed as the package
``minite.configs`` (so an installed minite finds them wherever it runs). Each kind of config has a
directory and a JSON schema beside it:

    kind    directory         schema                          loaded by
    arm     configs/arms/     configs/schemas/arm.schema.yaml    minite.engines.arms.load_arm
    model   configs/models/   configs/schemas/model.schema.yaml  minite.engines.models.load_model_config
    rl      configs/rl/       configs/schemas/rl.schema.yaml     minite.rl.config.load_rl_config

A config is named (``tiny`` -> configs/models/tiny.yaml) or given as a path to a .yaml / .yml file. Every
error names the file and the field, in the caller's exception class.
"""
from __future__ import annotations

import copy
import functools
from importlib import resources
from pathlib import Path

import yaml

#: the shipped configs (a directory of the installed package)
CONFIG_DIR = resources.files("minite.configs")
_DIRS = {"arm": "arms", "model": "models", "rl": "rl"}
_LABELS = {"arm": "arm", "model": "model", "rl": "RL config"}


def config_dir(kind: str):
    """The directory of the shipped configs of ``kind`` ("arm", "model", "rl")."""
    return CONFIG_DIR / _DIRS[kind]


def known_configs(kind: str) -> list[str]:
    """Names of the shipped configs of ``kind``, sorted."""
    return sorted(f.name.removesuffix(".yaml") for f in config_dir(kind).iterdir() if f.name.endswith(".yaml"))


def load_yaml(kind: str, name_or_path: str | Path, error: type[Exception]) -> tuple[dict, str]:
    """A shipped config's name, or a .yaml / .yml path -> (mapping, the file it came from). Unknown names list
    the known ones; invalid YAML and non-mapping documents raise ``error`` naming the file. Not validated:
    see ``validate``."""
    label, given = _LABELS[kind], str(name_or_path)
    path = Path(given) if given.endswith((".yaml", ".yml")) else config_dir(kind) / f"{given}.yaml"
    if not path.is_file():
        raise error(f"unknown {label} {given!r}: {path} not found; known {label}s: "
                    f"{', '.join(known_configs(kind))}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise error(f"{label} {path}: not valid YAML: {e}") from None
    raw = {} if raw is None else raw  # an empty file: every field from its defaults, or a missing-field error
    if not isinstance(raw, dict):
        raise error(f"{label} {path}: expected a mapping at the top level")
    return raw, str(path)


@functools.cache
def schema(kind: str) -> dict:
    """The JSON schema of ``kind`` (configs/schemas/<kind>.schema.yaml)."""
    return yaml.safe_load((CONFIG_DIR / "schemas" / f"{kind}.schema.yaml").read_text())


def validate(raw: dict, kind: str, source: str, error: type[Exception], fill_defaults: bool = False) -> dict:
    """JSON-schema check of a loaded config; the error names ``source`` (the file) and the offending field,
    dotted (``rl.lr``). Returns the config; with ``fill_defaults`` a new one, the schema's ``default``s filled
    in where it leaves a key out (only the rl schema declares defaults)."""
    import jsonschema  # imported here: loading YAML needs no schema machinery

    root = schema(kind)
    if fill_defaults:
        raw = _with_defaults(raw, root, root)
    try:
        jsonschema.validate(raw, root)
    except jsonschema.ValidationError as e:
        raise error(f"{_LABELS[kind]} {source}: {_describe(e)}") from None
    return raw


def defaults(kind: str) -> dict:
    """The config the schema's ``default``s make on their own (what an empty file loads as)."""
    root = schema(kind)
    return _with_defaults({}, root, root)


def _describe(e) -> str:
    path = [str(p) for p in e.absolute_path]
    if e.validator == "additionalProperties" and isinstance(e.instance, dict):
        known = sorted(e.schema.get("properties", {}))
        unknown = sorted(set(e.instance) - set(known))
        fields = ", ".join(".".join([*path, k]) for k in unknown)
        return f"{fields}: unknown field ({e.message}); known: {', '.join(known)}"
    return f"{'.'.join(path) or '(top level)'}: {e.message}"


def _resolve(node: dict | bool, root: dict) -> dict:
    if isinstance(node, bool):  # true / false schemas declare nothing
        return {}
    ref = node.get("$ref")
    if ref is None:
        return node
    if not ref.startswith("#/$defs/"):
        raise ValueError(f"schema $ref {ref!r}: only local #/$defs/ references are supported")
    return root["$defs"][ref.removeprefix("#/$defs/")]


def _with_defaults(value, node, root):
    """``value`` with the ``default``s of ``node`` (a schema) filled in, recursively, keys in the schema's
    order; an if/then/else picks the branch whose defaults apply. Keys the schema does not know are kept
    (validation reports them)."""
    import jsonschema

    node = _resolve(node, root)
    if not isinstance(value, dict):
        return value
    props = node.get("properties", {})
    out = {}
    for key, sub in props.items():
        if key in value:
            out[key] = _with_defaults(value[key], sub, root)
        elif "default" in _resolve(sub, root):
            out[key] = _with_defaults(copy.deepcopy(_resolve(sub, root)["default"]), sub, root)
    out.update({k: v for k, v in value.items() if k not in out})
    if "if" in node:
        branch = node.get("then" if jsonschema.Draft202012Validator(node["if"]).is_valid(out) else "else")
        if branch is not None:
            out = _with_defaults(out, branch, root)
    return out
