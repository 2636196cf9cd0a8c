"""Dotted config keys (`train.seq_len`) in a study: checked against the Config dataclasses
before any run is built, and read and set in nested YAML mappings keeping their order (the
written config lists its keys as the study's config does)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, get_args, get_origin

from pretrain.config import Config, ConfigError, config_key


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass an annotation holds (`X` or `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    if get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]  # type: ignore[return-value]
    return None


def check_config_key(key: str) -> None:
    """Refuse a key the config does not have (ConfigError naming the closest one).
    `inherit` and `inherit.SECTION` are the config file's own keys."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"{key!r} is not a dotted config key (e.g. train.seq_len)")
    sections = [config_key(f) for f in dataclasses.fields(Config)]
    if parts[0] == "inherit":
        if len(parts) > 2 or (len(parts) == 2 and parts[1] not in sections):
            raise ConfigError(f"{key}: inherit takes a file per section ({', '.join(sections)})")
        return
    cls: type | None = Config
    for i, part in enumerate(parts):
        if cls is None:  # the key goes on below a plain value
            raise ConfigError(f"{key}: {'.'.join(parts[:i])} is a value, not a section")
        hints = typing.get_type_hints(cls)
        fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
        where = ".".join(parts[:i])
        if part not in fields:
            near = difflib.get_close_matches(part, fields, n=1)
            hint = f" (did you mean {where + '.' if where else ''}{near[0]}?)" if near else ""
            raise ConfigError(
                f"unknown config key {key}{hint}; known keys of {where or 'the config'}: "
                f"{', '.join(fields)}"
            )
        tp = hints[fields[part].name]
        if tp is Any or get_origin(tp) is dict:
            return  # a free mapping (train.deepspeed): any key below it
        cls = _dataclass_of(tp)


def get_key(data: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in nested mappings."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in place: an existing key keeps its position, a new one goes last."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


__all__ = ["check_config_key", "get_key", "set_key"]
