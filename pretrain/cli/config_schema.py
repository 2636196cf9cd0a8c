"""Publish the config's schema: JSON Schemas for editors and docs/configuration.md's tables.

    python tools/config_schema.py            # write schemas/*.schema.json and the docs' tables
    python tools/config_schema.py --check    # write nothing; exit 1 if any of them is stale

A field is declared once, in the sections beside their features; these files are generated
from them: a run config's, a model preset's (configs/models/) and a study file's JSON Schema,
which an editor with the YAML language server validates and completes a file against
(docs/configuration.md, "Editor support"). `make lint` runs --check.
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
from pretrain.schema import admits_none, bounds_text, field_bounds, sections, type_name, yaml_key
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


# schemas/NAME.schema.json: the model it describes, its title.
PUBLISHED: dict[str, tuple[type[BaseModel], str]] = {
    "config": (Config, "A run config of the pretraining toolkit"),
    "model": (ModelConfig, "A model preset (configs/models/)"),
    "study": (StudyFile, "A study file of the pretraining toolkit (studies/)"),
}


def json_schemas() -> dict[str, dict[str, Any]]:
    """File name under schemas/ -> its JSON Schema."""
    out = {}
    for name, (model, title) in PUBLISHED.items():
        schema = model.model_json_schema(by_alias=True)
        props = schema["properties"]
        if model is StudyFile:  # a study's `config:` is a run config (or the path of one)
            props["config"] = {
                "description": props["config"].get("description", ""),
                "anyOf": [{"type": "string"}, {"$ref": "config.schema.json"}],
            }
        else:
            schema["properties"] = {"inherit": INHERIT, **props}
        out[f"{name}.schema.json"] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"{name}.schema.json",
            **schema,
            "title": title,
        }
    return out


def _value(v: Any) -> str:
    """A default as YAML flow style reads it (null, true, [0.9, 0.95]), with 1e-8 for 1e-08."""
    if isinstance(v, str):
        return v
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", json.dumps(v)).replace("e+", "e")


def field_table(model: type[BaseModel]) -> str:
    """A section's markdown table: key, type (with its bounds), default, meaning."""
    rows = []
    for name, f in model.model_fields.items():
        default = f.get_default(call_default_factory=True)
        default = "required" if default is PydanticUndefined else _value(default)
        kind = " ".join(filter(None, [type_name(f.annotation), bounds_text(field_bounds(f))]))
        kind += " or null" if admits_none(f.annotation) else ""
        meaning = (f.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append([yaml_key(model, name), kind, default, meaning])
    return pipe_table(["key", "type", "default", "meaning"], rows)


def render_doc(text: str) -> str:
    """docs/configuration.md with every generated table replaced by the schema's."""
    known = sections(Config)
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
    files = {repo / SCHEMAS / n: json.dumps(s, indent=2) + "\n" for n, s in json_schemas().items()}
    return {**files, repo / DOC: render_doc((repo / DOC).read_text())}


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
    files = outputs(args.repo)
    stale = [p for p, content in files.items() if not (p.is_file() and p.read_text() == content)]
    if not args.check:
        for path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[path])
    names = ", ".join(p.relative_to(args.repo).as_posix() for p in stale)
    if args.check and stale:
        print(
            f"stale: {names}; run `python tools/config_schema.py` and commit the result",
            file=sys.stderr,
        )
        return 1
    print(f"{'stale' if args.check else 'wrote'}: {names}" if stale else "up to date")
    return 0
