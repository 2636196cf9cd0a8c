"""Every config under configs/ and every run of studies/*.yaml, resolved to plain values.

`python tests/resolved_configs.py OUT.json.gz` records them; tests/test_config_schema.py
compares the loader's answer today with the record taken before the config became a pydantic
schema (issue 42), field by field. A field added since the record is absent from it: it counts
as unchanged where it holds its default (`default_of`).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).resolve().parent / "data" / "resolved_configs.json.gz"


def resolve_all(repo: Path = REPO) -> dict[str, dict]:
    """'configs/X.yaml' -> its resolved config; 'studies/S.yaml:RUN' -> the run's resolved
    config and the content of the config file `write` gives it."""
    from pretrain.config import load_config, load_model_config, to_dict
    from pretrain.study import load_study

    out: dict[str, dict] = {}
    for path in sorted((repo / "configs").rglob("*.yaml")):
        rel = path.relative_to(repo).as_posix()
        if rel.startswith("configs/models/"):
            out[rel] = {"model": to_dict(load_model_config(path))}
        else:
            out[rel] = to_dict(load_config(path))
    for path in sorted((repo / "studies").glob("*.yaml")):
        rel = path.relative_to(repo).as_posix()
        for run in load_study(path).runs:
            out[f"{rel}:{run.name}"] = {
                "config": run.config,
                "config_file": run.config_file,
                "overrides": list(run.overrides),
            }
    # Through JSON, so that tuples and lists compare alike on both sides.
    return json.loads(json.dumps(out))


def default_of(key: str) -> tuple[bool, object]:
    """(True, the default) of a dotted key of the record ('train.seed', a study run's
    'config.model.rope_scaling.low_freq_factor'), as plain values; (False, None) for a key that
    is no field with a default (a study's `config_file` text, a list's items)."""
    from pydantic_core import PydanticUndefined

    from pretrain.config import Config, to_dict
    from pretrain.schema import section_of, yaml_keys

    parts = key.split(".")
    if parts[0] == "config":  # a study run's resolved config
        parts = parts[1:]
    section: type | None = Config
    for i, part in enumerate(parts):
        fields = yaml_keys(section) if section is not None else {}
        if part not in fields:
            return False, None
        info = section.model_fields[fields[part]]  # type: ignore[union-attr]
        if i < len(parts) - 1:
            section = section_of(info.annotation)
            continue
        if info.default is not PydanticUndefined:
            value = info.default
        elif info.default_factory is not None:
            value = info.default_factory()  # type: ignore[call-arg]
        else:
            return False, None
        return True, json.loads(json.dumps(to_dict(value)))
    return False, None


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else RECORD
    with gzip.open(target, "wt") as f:
        json.dump(resolve_all(), f, sort_keys=True)
    print(f"wrote {target}")
