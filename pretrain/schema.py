"""The base of the config schema: a typed `Section`, the field types, and one-line errors.

Every config section is a pydantic model declared beside its feature (pretrain/model/config.py,
pretrain/data/config.py, pretrain/train/config.py, pretrain/eval/config.py; the study file's
in pretrain/study/). Pydantic checks types, bounds and unknown keys and runs each section's
validators; this module turns its report into the toolkit's one line, `KEY=VALUE <problem>;
<fix>`, with did-you-mean for an unknown key, so a typo in a 100-GPU job fails in the first
second with a message a user can act on.

Field types are pydantic's, with three of our own where YAML and pydantic's lax mode disagree
with what a user means: `Int` (no bools or strings; 3.0 is 3), `Float` (no bools; YAML 1.1
reads `4e-4` as a string, which is read as the number; NaN refused) and `Bool` (true or false
only, never "yes" or 1).
"""

from __future__ import annotations

import contextvars
import difflib
import math
import types
import typing
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool, ValidationError

from pretrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value is wrong; the message names the key and the fix."""

    label = "config error"


def _integer(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


def _number(value: Any) -> Any:
    if isinstance(value, str):  # YAML 1.1 reads 4e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise ValueError("must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if math.isnan(value):
        raise ValueError("must be a number, not NaN")
    return value


Int = Annotated[int, BeforeValidator(_integer)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = StrictBool


_Self = TypeVar("_Self", bound="Section")
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("section_depth", default=0)


class Section(BaseModel):
    """A config section: unknown keys refused, each field's description its docstring.

    `key` is where the section sits in a run config ("model", "train"), the prefix of its
    errors. Building one directly (`ModelConfig(n_heads=5)`) raises `ConfigError` like
    loading a file does.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        use_attribute_docstrings=True,
    )
    key: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        # Pydantic calls a custom __init__ for nested sections too: only the outermost turns
        # the report into our one line, so that the key keeps its full path.
        token = _depth.set(_depth.get() + 1)
        try:
            super().__init__(**data)
        except ValidationError as e:
            if _depth.get() > 1:
                raise
            raise config_error(e, type(self), type(self).key) from None
        finally:
            _depth.reset(token)

    def replace(self: _Self, **changes: Any) -> _Self:
        """A copy with `changes`, validated as a new section (pydantic's model_copy is not)."""
        cls = type(self)
        # By YAML key (`head_dim`, `async`), whether a change names the key or the field.
        keyed = {yaml_key(cls, k) if k in cls.model_fields else k: v for k, v in changes.items()}
        return cls(**{**self.model_dump(by_alias=True), **keyed})


S = TypeVar("S", bound=BaseModel)


def validate_section(cls: type[S], data: Any) -> S:
    """`cls.model_validate(data)`, pydantic's ValidationError left as it is (for callers that
    word it their own way; `from_dict` words it as a ConfigError)."""
    token = _depth.set(_depth.get() + 1)
    try:
        return cls.model_validate(data)
    finally:
        _depth.reset(token)


def from_dict(cls: type[S], data: Any, prefix: str | None = None) -> S:
    """Validate `data` (a mapping, None = {}) as section `cls`; errors name `prefix.key`."""
    prefix = cls.key if prefix is None and issubclass(cls, Section) else (prefix or "")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    try:
        return validate_section(cls, data)
    except ValidationError as e:
        raise config_error(e, cls, prefix) from None


def to_dict(obj: Any) -> Any:
    """A section -> plain YAML-safe values (tuples become lists; YAML keys, e.g. `async`)."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(by_alias=True)
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- errors


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The section an annotation holds (`X`, `X | None`, `list[X]`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = section_of(arg)
        if found is not None:
            return found
    return None


def did_you_mean(word: str, choices: Any, prefix: str = "") -> str:
    """' (did you mean PREFIX+NEAREST?)' for the closest of `choices`, or ''."""
    near = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {prefix}{near[0]}?)" if near else ""


def yaml_key(cls: type[BaseModel], name: str) -> str:
    """A field's key in YAML and --set: its alias where the name cannot be one (`async`)."""
    return cls.model_fields[name].alias or name


def yaml_keys(cls: type[BaseModel]) -> dict[str, str]:
    """YAML key -> field name, in declaration order."""
    return {yaml_key(cls, n): n for n in cls.model_fields}


def type_name(tp: Any) -> str:
    """The annotation as a user reads it: "bool or 'auto'", not "Union"."""
    origin = get_origin(tp)
    if origin is Annotated:
        return type_name(get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp) if a is not type(None))
    if origin is Literal:
        return " or ".join(map(repr, get_args(tp)))
    if origin in (list, tuple):
        return "a list"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _literal_choices(tp: Any) -> tuple[Any, ...]:
    """The choices of the first Literal in an annotation (`Literal[...]`, `list[Literal]`)."""
    if get_origin(tp) is Literal:
        return get_args(tp)
    for arg in get_args(tp):
        found = _literal_choices(arg)
        if found:
            return found
    return ()


def admits_none(tp: Any) -> bool:
    return tp is None or type(None) in get_args(tp)


_PROBLEMS = {
    "bool": "must be true or false",
    "int": "must be an integer",
    "float": "must be a number",
    "string": "must be a string",
    "list": "must be a list",
    "tuple": "must be a list",
    "set": "must be a list",
    "dict": "must be a mapping",
    "model": "must be a mapping",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}

# Keys that moved, old -> new: a config using the old name gets told the new one.
MOVED = {"logging.spike_window": "spikes.window", "logging.spike_threshold": "spikes.threshold"}


def config_error(e: ValidationError, cls: type[BaseModel], prefix: str = "") -> ConfigError:
    """Pydantic's first error as our one line: the dotted key, the value, the problem, the fix."""
    err = e.errors(include_url=False)[0]
    key, section, annotation, union = prefix, cls, None, False
    parent = prefix
    for part in err["loc"]:
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        fields = yaml_keys(section) if section is not None else {}
        if part in fields:
            parent = key
            key = f"{key}.{part}" if key else str(part)
            annotation = section.model_fields[fields[part]].annotation  # type: ignore[union-attr]
            section = section_of(annotation)
        elif err["type"] == "extra_forbidden" and part == err["loc"][-1]:
            parent = key
            key = f"{key}.{part}" if key else str(part)
        else:  # a union's member tag: the value fits none of the field's types
            union = True
            break
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        if key in MOVED:
            return ConfigError(f"{key} is now {MOVED[key]}; rename it in your config")
        known = list(yaml_keys(section)) if section is not None else []
        hint = did_you_mean(key.rpartition(".")[2], known, f"{parent}." if parent else "")
        return ConfigError(
            f"unknown key {key}{hint}; known keys of {parent or 'the config'}: {', '.join(known)}"
        )
    if union:
        return ConfigError(
            f"{key}={value!r} has the wrong type; expected {type_name(annotation)}"
            + (" (or null)" if admits_none(annotation) else "")
        )
    if kind == "value_error":
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            return cause
        return ConfigError(f"{key}={value!r} {cause or err['msg']}")
    if kind == "missing":
        return ConfigError(f"{key} is missing; give it a value")
    if kind == "literal_error":
        choices = _literal_choices(annotation)
        expected = ", ".join(map(repr, choices)) if choices else err["ctx"]["expected"]
        return ConfigError(f"{key}={value!r} is not allowed; use one of {expected}")
    if kind in _BOUNDS:
        bound = next(iter((err.get("ctx") or {}).values()), "")
        return ConfigError(f"{key}={value!r} must be {_BOUNDS[kind]} {bound}")
    if kind in ("too_short", "too_long"):
        return ConfigError(f"{key}={value!r} has the wrong number of items")
    problem = _PROBLEMS.get(kind.split("_")[0], err["msg"].lower())
    null = " (or null)" if admits_none(annotation) else ""
    return ConfigError(f"{key}={value!r} {problem}{null}")


__all__ = [
    "Bool",
    "ConfigError",
    "Float",
    "Int",
    "MOVED",
    "Section",
    "admits_none",
    "config_error",
    "did_you_mean",
    "from_dict",
    "section_of",
    "to_dict",
    "type_name",
    "validate_section",
    "yaml_key",
    "yaml_keys",
]
