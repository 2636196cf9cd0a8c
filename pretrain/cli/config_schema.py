"""Publish the config's schema: JSON Schemas for editors and docs/configuration.md's tables.

    python tools/config_schema.py            # write schemas/*.schema.json and the docs' tables
    python tools/config_schema.py --check    # write nothing; exit 1 if any of them is stale

The schema is the one place a field is declared (pretrain/config.py and the sections beside
their features); everything here is generated from it. `schemas/config.schema.json` describes
a run config, `schemas/model.schema.json` a model preset (configs/models/), and
`schemas/study.schema.json` a study file (its `config:` is a run config). An editor with the
YAML language server validates and completes a file against them (docs/configuration.md,
"Editor support"). CI runs --check (tests/test_config_schema.py), and so does `make lint`, so
neither the schemas nor the docs' tables can drift from the code.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import Config, ModelConfig
from pretrain.schema import (
    admits_none,
    bounds_text,
    field_bounds,
    section_of,
    type_name,
    yaml_key,
)
from pretrain.study.file import StudyFile
from pretrain.tables import pipe_table

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = "schemas"
DOC = "docs/configuration.md"
# A generated table sits between these lines, one per section: `<!-- fields: model -->`.
BEGIN = re.compile(r"^<!-- fields: ([\w.\[\]]+) -->$", re.M)
END = "<!-- end of generated fields -->"
INHERIT = {
    "description": "Files merged under this one: a path or list of paths (relative to the "
    "file), or {section: path} (a model preset under `model:`); this file's keys win.",
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "object", "additionalProperties": {"type": "string"}},
    ],
}


def _schema(model: type[BaseModel], title: str, name: str) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    schema["properties"] = {"inherit": INHERIT, **schema["properties"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"{name}.schema.json",
        **schema,
        "title": title,
    }


def json_schemas() -> dict[str, dict[str, Any]]:
    """File name under schemas/ -> its JSON Schema."""
    run = _schema(Config, "A run config of the pretraining toolkit", "config")
    study = StudyFile.model_json_schema(by_alias=True)
    # A study's `config:` is a run config (or the path of one).
    study["properties"]["config"] = {
        "description": study["properties"]["config"].get("description", ""),
        "anyOf": [{"type": "string"}, {"$ref": "config.schema.json"}],
    }
    return {
        "config.schema.json": run,
        "model.schema.json": _schema(ModelConfig, "A model preset (configs/models/)", "model"),
        "study.schema.json": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "study.schema.json",
            **study,
            "title": "A study file of the pretraining toolkit (studies/)",
        },
    }


def sections(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section reachable from `model`, by its key: model, model.rope_scaling, ..."""
    out: dict[str, type[BaseModel]] = {}
    for name, f in model.model_fields.items():
        inner = section_of(f.annotation)
        if inner is None:
            continue
        key = f"{prefix}{yaml_key(model, name)}" + ("[]" if "list" in str(f.annotation) else "")
        out[key] = inner
        out.update(sections(inner, key + "."))
    return out


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(v)).replace("e+", "e")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def field_table(model: type[BaseModel]) -> str:
    """A section's markdown table: key, type (with its bounds), default, meaning (the field's
    description)."""
    rows = []
    for name, f in model.model_fields.items():
        if f.default is not PydanticUndefined:
            default = _value(f.default)
        elif f.default_factory is not None:
            default = _value(f.default_factory())  # type: ignore[call-arg]
        else:
            default = "required"
        bounds = bounds_text(field_bounds(f))
        kind = (
            type_name(f.annotation)
            + (f" {bounds}" if bounds else "")
            + (" or null" if admits_none(f.annotation) else "")
        )
        meaning = (f.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append([yaml_key(model, name), kind, default, meaning])
    return pipe_table(["key", "type", "default", "meaning"], rows)


def render_doc(text: str) -> str:
    """docs/configuration.md with every generated table replaced by the schema's."""
    known = sections()
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        key = m.group(1)
        if key not in known:
            raise SystemExit(
                f"{DOC}: `<!-- fields: {key} -->` names no section; known: {', '.join(known)}"
            )
        end = text.find(END, m.end())
        if end < 0:
            raise SystemExit(f"{DOC}: the table of {key} has no `{END}` line")
        out += [text[pos : m.end()], "\n", field_table(known[key]), "\n"]
        pos = end
    missing = sorted(set(known) - set(BEGIN.findall(text)))
    if missing:
        raise SystemExit(
            f"{DOC}: no generated table for {', '.join(missing)}; add `<!-- fields: KEY -->` and `{END}` lines"
        )
    return "".join(out) + text[pos:]


def outputs(repo: Path = REPO) -> dict[Path, str]:
    """Every generated file -> its content."""
    files = {
        repo / SCHEMAS / name: json.dumps(schema, indent=2) + "\n"
        for name, schema in json_schemas().items()
    }
    doc = repo / DOC
    files[doc] = render_doc(doc.read_text())
    return files


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 and name every file that differs from the schema",
    )
    parser.add_argument(
        "--repo", type=Path, default=REPO, help="the repository root (default: this checkout)"
    )
    args = parser.parse_args(argv)
    stale = []
    for path, content in outputs(args.repo).items():
        if path.is_file() and path.read_text() == content:
            continue
        stale.append(path.relative_to(args.repo).as_posix())
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    if args.check and stale:
        print(
            f"stale: {', '.join(stale)}; run `python tools/config_schema.py` and commit the result",
            file=sys.stderr,
        )
        return 1
    print(f"{'stale' if args.check else 'wrote'}: {', '.join(stale)}" if stale else "up to date")
    return 0


__all__ = ["field_table", "json_schemas", "main", "outputs", "render_doc", "sections"]
