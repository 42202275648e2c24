"""Named YAML configs (configs/<kind>s/<name>.yaml or a path): one loader with the same clear errors."""
from __future__ import annotations

from pathlib import Path

import yaml


def load_named_yaml(name_or_path: str | Path, directory: Path, kind: str, error: type[Exception]
                    ) -> tuple[dict, Path]:
    """``name`` -> directory/name.yaml, or a .yaml/.yml path -> (mapping, path). Unknown names list the known
    ones; invalid YAML and non-mapping documents raise ``error`` naming the file."""
    p = Path(name_or_path)
    if p.suffix not in (".yaml", ".yml"):
        p = directory / f"{name_or_path}.yaml"
    if not p.is_file():
        known = sorted(f.stem for f in directory.glob("*.yaml"))
        raise error(f"unknown {kind} {str(name_or_path)!r}; known {kind}s: {', '.join(known)}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise error(f"{kind} {p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise error(f"{kind} {p}: expected a mapping at the top level")
    return raw, p


def validate_schema(raw: dict, schema_path: Path, kind: str, source: str, error: type[Exception]) -> None:
    """JSON-schema check of a loaded config; the error names the file and the offending field."""
    import jsonschema  # imported here: the loader above is used where no schema is needed

    try:
        jsonschema.validate(raw, yaml.safe_load(Path(schema_path).read_text()))
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise error(f"{kind} {source}: {where}: {e.message}") from None
