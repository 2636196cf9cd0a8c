"""What every part of a study uses: the one-line error naming the study file, the field and
the fix (`StudyError`, `Where`), config keys, labels and templates."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError, check_key
from pretrain.errors import UserError
from pretrain.schema import did_you_mean


class StudyError(UserError, ValueError):
    """A study file that cannot be expanded into runs."""

    label = "study error"


LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_TEMPLATE_FIELD = re.compile(r"\{([A-Za-z_]\w*(?:\.text)?)\}")


class Where:
    """Says which study file, and which field of it, an error is about."""

    def __init__(self, path: Path):
        self.path = path

    def error(self, where: str, problem: str, fix: str) -> StudyError:
        return StudyError(f"{shown_path(self.path)}: {where}: {problem}; {fix}")


def shown_path(path: Path) -> str:
    """A path as the user would name it: from the current folder when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if rel.startswith("..") else rel


def checked_key(w: Where, where: str, key: Any, fix: str) -> str:
    """`key` if it names a config key (pretrain/config.py check_key), else one line."""
    try:
        check_key(str(key))
    except ConfigError as e:
        raise w.error(where, str(e), fix) from None
    return str(key)


def label_of(value: Any) -> str | None:
    """A value's label (true, 500, 0.0003, text); None for a list or mapping, which needs one
    given."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if isinstance(value, (int, str)) else None


def render_template(w: Where, where: str, template: str, values: dict[str, str]) -> str:
    def field_value(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise w.error(
                where,
                f"{{{name}}} is not known here{did_you_mean(name, values)}",
                f"use {', '.join('{' + k + '}' for k in values)}",
            )
        return values[name]

    return _TEMPLATE_FIELD.sub(field_value, template)


__all__ = [
    "LABEL",
    "StudyError",
    "Where",
    "checked_key",
    "label_of",
    "render_template",
    "shown_path",
]
