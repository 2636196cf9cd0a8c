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
only, never "yes" or 1); and two kinds built on them: `Seconds` (finite, >= 0) and
`int_choice(0, 1, 2)` (an `Int` among a few).

A rule of one field is a constraint of the field itself (`Field(gt=0)`, `ge=`/`le=`/`lt=`, a
`Literal`), never a validator, so that the JSON Schema an editor checks a file against
(tools/config_schema.py) refuses what the loader refuses; validators hold the rules across
fields. Its error reads `KEY=VALUE must be > 0`, `... must be in [0, 1]` or `... is not
allowed; use one of ...`, ending with the field's `Hint` where it has one:
`grad_clip: Annotated[Float, Hint("0 = no clipping")] = Field(1.0, ge=0)` gives
`optim.grad_clip=-1 must be >= 0 (0 = no clipping)`.
"""

from __future__ import annotations

import contextvars
import difflib
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

import annotated_types
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StrictBool,
    ValidationError,
)
from pydantic.fields import FieldInfo

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
Seconds = Annotated[float, BeforeValidator(_number), annotated_types.Ge(0), AllowInfNan(False)]
"""A duration in seconds: a finite number >= 0."""


def int_choice(*choices: int) -> Any:
    """An `Int` that must be one of `choices` (an `enum` in the JSON Schema): `int_choice(0, 1, 2)`."""
    return Annotated[Literal[choices], BeforeValidator(_integer)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class Hint:
    """What a field's bound or choices mean, appended to its error in parentheses:
    `Annotated[Float, Hint("0 = no clipping")]`."""

    text: str


# Pydantic writes a bound it cannot put on the inner type (a field `X | None`, a list's items,
# a union's member: wherever our BeforeValidator wraps it) under its own name, `ge`, which a
# JSON Schema validator ignores; these are the JSON Schema keywords.
_JSON_BOUNDS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
}


def _json_bounds(node: Any) -> None:
    """Rename pydantic's `ge`/`gt`/`le`/`lt` in a section's JSON Schema to JSON Schema's."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for ours, theirs in _JSON_BOUNDS.items():
                if ours in node:
                    node[theirs] = node.pop(ours)
        for value in node.values():
            _json_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _json_bounds(value)


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
        json_schema_extra=_json_bounds,
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
    "finite": "must be a finite number",
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


def _number_text(x: Any) -> str:
    """A bound as a user writes it: 0, not 0.0; 1e-08 as 1e-08."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x)


def field_bounds(info: FieldInfo | None) -> dict[str, Any]:
    """A field's own bounds, {'>=': 0, '<': 1} (not those of its items or union members)."""
    out: dict[str, Any] = {}
    for m in info.metadata if info is not None else ():
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(m, attr, None)
            if isinstance(m, annotated_types.BaseMetadata) and value is not None:
                out[op] = value
    return out


def bounds_text(bounds: dict[str, Any]) -> str:
    """'> 0', '>= 2', 'in [0, 1]', 'in [0, 1)' (both ends in one interval); '' for none."""
    lo = next(((op, v) for op, v in bounds.items() if op in (">", ">=")), None)
    hi = next(((op, v) for op, v in bounds.items() if op in ("<", "<=")), None)
    if lo and hi:
        left, right = "[" if lo[0] == ">=" else "(", "]" if hi[0] == "<=" else ")"
        return f"in {left}{_number_text(lo[1])}, {_number_text(hi[1])}{right}"
    one = lo or hi
    return f"{one[0]} {_number_text(one[1])}" if one else ""


def field_hint(info: FieldInfo | None) -> str:
    """' (HINT)' for a field with a `Hint`, else ''."""
    hints = [m.text for m in (info.metadata if info is not None else ()) if isinstance(m, Hint)]
    return f" ({hints[0]})" if hints else ""


def config_error(e: ValidationError, cls: type[BaseModel], prefix: str = "") -> ConfigError:
    """Pydantic's first error as our one line: the dotted key, the value, the problem, the fix."""
    errors = e.errors(include_url=False)
    err = errors[0]
    key, section, annotation, info, union = prefix, cls, None, None, False
    parent = prefix
    for depth, part in enumerate(err["loc"]):
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        fields = yaml_keys(section) if section is not None else {}
        if part in fields:
            parent = key
            key = f"{key}.{part}" if key else str(part)
            info = section.model_fields[fields[part]]  # type: ignore[union-attr]
            annotation = info.annotation
            section = section_of(annotation)
        elif err["type"] == "extra_forbidden" and part == err["loc"][-1]:
            parent = key
            key = f"{key}.{part}" if key else str(part)
        else:  # a union's member tag: the value fits none of the field's types
            union = True
            # ... unless it has the type of a member and is outside that member's bounds
            # (`activation_checkpointing: -1`): that member's error is the one to give.
            at = err["loc"][:depth]
            bound = [x for x in errors if x["type"] in _BOUNDS and x["loc"][:depth] == at]
            if bound:
                err, union = bound[0], False
            break
    value = err.get("input")
    kind = err["type"]
    hint = field_hint(info)
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
        return ConfigError(f"{key}={value!r} is not allowed; use one of {expected}{hint}")
    if kind in _BOUNDS:
        op = _BOUNDS[kind]
        bound = next(iter((err.get("ctx") or {}).values()), "")
        own = field_bounds(info)
        # The field's own interval when this is one of its ends; an item's bound on its own.
        text = bounds_text(own) if op in own else bounds_text({op: bound})
        return ConfigError(f"{key}={value!r} must be {text}{hint}")
    if kind in ("too_short", "too_long"):
        return ConfigError(f"{key}={value!r} has the wrong number of items")
    problem = _PROBLEMS.get(kind.split("_")[0], err["msg"].lower())
    null = " (or null)" if admits_none(annotation) else ""
    if kind == "finite_number":
        return ConfigError(f"{key}={value!r} {problem}{hint}")
    return ConfigError(f"{key}={value!r} {problem}{null}")


__all__ = [
    "Bool",
    "ConfigError",
    "Float",
    "Hint",
    "Int",
    "MOVED",
    "Seconds",
    "Section",
    "admits_none",
    "bounds_text",
    "config_error",
    "did_you_mean",
    "field_bounds",
    "field_hint",
    "from_dict",
    "int_choice",
    "section_of",
    "to_dict",
    "type_name",
    "validate_section",
    "yaml_key",
    "yaml_keys",
]
