"""The base of the config schema: a typed `Section`, the field types, and one-line errors.

Pydantic checks each section (pretrain/*/config.py, pretrain/study/); its report becomes one
line, `KEY=VALUE <problem>`, with did-you-mean for an unknown key. Our field types are where
YAML and pydantic's lax mode disagree with a user: `Int` (no bools or strings; 3.0 is 3),
`Float` (no bools; YAML 1.1 reads `4e-4` as a string; NaN refused), `Bool` (never "yes" or 1).

A rule of one field is a constraint of the field (`Field(gt=0)`, a `Literal`), never a
validator, so that the JSON Schema (tools/config_schema.py) refuses what the loader refuses;
validators hold the rules across fields. A field's `Hint` ends its error:
`grad_clip: Annotated[Float, Hint("0 = no clipping")] = Field(1.0, ge=0)` gives
`optim.grad_clip=-1 must be >= 0 (0 = no clipping)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError
from pydantic.fields import FieldInfo

from pretrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value is wrong; the message names the key and the fix."""

    label = "config error"


def _integer(value: Any) -> Any:
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ValueError("must be an integer")
    return int(value)


def _number(value: Any) -> Any:
    if isinstance(value, str):  # YAML 1.1 reads 4e-4 (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if math.isnan(value):
        raise ValueError("must be a number, not NaN")
    return value


Int = Annotated[int, BeforeValidator(_integer)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = StrictBool
Seconds = Annotated[float, BeforeValidator(_number), Field(ge=0, allow_inf_nan=False)]
"""A duration in seconds: a finite number >= 0."""


def int_choice(*choices: int) -> Any:
    """An `Int` among `choices` (an `enum` in the JSON Schema)."""
    return Annotated[Literal[choices], BeforeValidator(_integer)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class Hint:
    """What a field's bound or choices mean, ending its error: `Hint("0 = no clipping")`."""

    text: str


# Pydantic writes a bound it cannot put on the inner type (wherever our BeforeValidator wraps
# it: `X | None`, a list's items) under its own name, `ge`, which JSON Schema ignores.
_JSON_BOUNDS = dict(ge="minimum", gt="exclusiveMinimum", le="maximum", lt="exclusiveMaximum")


def _json_bounds(node: Any) -> None:
    """Rename pydantic's `ge`/`gt`/`le`/`lt` in a section's JSON Schema to JSON Schema's."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for ours, theirs in _JSON_BOUNDS.items():
                if ours in node:
                    node[theirs] = node.pop(ours)
        node = list(node.values())
    for value in node if isinstance(node, list) else ():
        _json_bounds(value)


S = TypeVar("S", bound=BaseModel)
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("section_depth", default=0)


class Section(BaseModel):
    """A config section: unknown keys refused, each field's description its docstring.

    `key` is where the section sits in a run config ("model", "train"), the prefix of its
    errors. Building one directly (`ModelConfig(n_heads=5)`) raises `ConfigError` too.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_by_name=True,
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

    def replace(self: S, **changes: Any) -> S:
        """A copy with `changes`, validated as a new section (pydantic's model_copy is not)."""
        cls = type(self)
        # By YAML key (`head_dim`, `async`), whether a change names the key or the field.
        keyed = {yaml_key(cls, k) if k in cls.model_fields else k: v for k, v in changes.items()}
        return cls(**{**self.model_dump(by_alias=True), **keyed})


def validate_section(cls: type[S], data: Any) -> S:
    """`cls.model_validate(data)` raising pydantic's ValidationError (`from_dict` words it)."""
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


def _first(tp: Any, pick: Callable[[Any], Any]) -> Any:
    """`pick(part)` of the first part of an annotation (depth first) where it is not None."""
    found = pick(tp)
    for arg in get_args(tp) if found is None else ():
        found = _first(arg, pick)
        if found is not None:
            break
    return found


def _named_sections(tp: Any) -> Any:
    """`tp` if it is a mapping of user-named sections (`dict[str, AxisSpec]`), else None."""
    return tp if get_origin(tp) is dict and section_of(get_args(tp)[1]) else None


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The section an annotation holds (`X`, `X | None`, `list[X]`), else None."""
    return _first(
        annotation, lambda t: t if isinstance(t, type) and issubclass(t, BaseModel) else None
    )


def sections(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section below `model` by dotted key (model.rope_scaling; a list's: spikes.faults[])."""
    out: dict[str, type[BaseModel]] = {}
    for name, f in model.model_fields.items():
        inner = section_of(f.annotation)
        if inner is not None:
            key = f"{prefix}{yaml_key(model, name)}" + ("[]" if "list" in str(f.annotation) else "")
            out[key] = inner
            out.update(sections(inner, key + "."))
    return out


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
    if origin is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return "a mapping"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def admits_none(tp: Any) -> bool:
    return tp is None or type(None) in get_args(tp)


_PROBLEMS = {
    "bool": "must be true or false",
    "int": "must be an integer",
    "float": "must be a number",
    "finite": "must be a finite number",
    "string": "must be a string",
    **dict.fromkeys(("list", "tuple", "set"), "must be a list"),
    **dict.fromkeys(("dict", "model"), "must be a mapping"),
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}

# Keys that moved, old -> new: a config using the old name gets told the new one.
_MOVED = {"logging.spike_window": "spikes.window", "logging.spike_threshold": "spikes.threshold"}


def _number_text(x: Any) -> str:
    """A bound as a user writes it: 0, not 0.0; 1e-08 as 1e-08."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


def field_bounds(info: FieldInfo | None) -> dict[str, Any]:
    """A field's own bounds, {'>=': 0, '<': 1} (not those of its items or union members)."""
    return {
        op: getattr(m, attr)
        for m in (info.metadata if info is not None else ())
        if isinstance(m, annotated_types.BaseMetadata)
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        if getattr(m, attr, None) is not None
    }


def bounds_text(bounds: dict[str, Any]) -> str:
    """'> 0', '>= 2', 'in [0, 1]', 'in [0, 1)' (both ends in one interval); '' for none."""
    lo = next(((op, v) for op, v in bounds.items() if op in (">", ">=")), None)
    hi = next(((op, v) for op, v in bounds.items() if op in ("<", "<=")), None)
    if lo and hi:
        left, right = "[" if lo[0] == ">=" else "(", "]" if hi[0] == "<=" else ")"
        return f"in {left}{_number_text(lo[1])}, {_number_text(hi[1])}{right}"
    one = lo or hi
    return f"{one[0]} {_number_text(one[1])}" if one else ""


def config_error(
    e: ValidationError, cls: type[BaseModel], prefix: str = "", top: str = "the config"
) -> ConfigError:
    """Pydantic's first error as our one line: the dotted key, the value, the problem, the fix.
    `top` names the whole mapping in an unknown top-level key's line."""
    errors = e.errors(include_url=False)
    # An unknown key first: beside another error (`slurm: {nodes: 0, nodse: 1}`) it is the mistake.
    err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    key, section, annotation, info, union = prefix, cls, None, None, False
    parent, named = prefix, False
    for depth, part in enumerate(err["loc"]):
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        if named:  # the user's name in a mapping of sections (a study's `axes: NAME:`)
            key, named, annotation, info = f"{key}.{part}", False, section, None
            continue
        fields = yaml_keys(section) if section is not None else {}
        unknown = err["type"] == "extra_forbidden" and part == err["loc"][-1]
        if part not in fields and not unknown:
            # A union's member tag: the value fits none of the field's types, unless it has
            # the type of a member and is outside that member's bounds
            # (`activation_checkpointing: -1`): that member's error is the one to give.
            at = err["loc"][:depth]
            bound = [x for x in errors if x["type"] in _BOUNDS and x["loc"][:depth] == at]
            err, union = (bound[0], False) if bound else (err, True)
            break
        parent, key = key, f"{key}.{part}" if key else str(part)
        if part in fields:
            info = section.model_fields[fields[part]]  # type: ignore[union-attr]
            annotation = info.annotation
            section = section_of(annotation)
            named = _first(annotation, _named_sections) is not None
    value = err.get("input")
    kind = err["type"]
    hints = [m.text for m in (info.metadata if info is not None else ()) if isinstance(m, Hint)]
    hint = f" ({hints[0]})" if hints else ""
    null = " (or null)" if admits_none(annotation) else ""
    if kind == "extra_forbidden":
        if key in _MOVED:
            return ConfigError(f"{key} is now {_MOVED[key]}; rename it in your config")
        known = list(yaml_keys(section)) if section is not None else []
        hint = did_you_mean(key.rpartition(".")[2], known, f"{parent}." if parent else "")
        return ConfigError(
            f"unknown key {key}{hint}; known keys of {parent or top}: {', '.join(known)}"
        )
    if union:
        return ConfigError(
            f"{key}={value!r} has the wrong type; expected {type_name(annotation)}{null}"
        )
    if kind == "value_error":
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            return cause
        return ConfigError(f"{key}={value!r} {cause or err['msg']}")
    if kind == "missing":
        return ConfigError(f"{key} is missing; give it a value")
    if kind == "literal_error":
        choices = _first(annotation, lambda t: get_args(t) if get_origin(t) is Literal else None)
        expected = ", ".join(map(repr, choices)) if choices else err["ctx"]["expected"]
        return ConfigError(f"{key}={value!r} is not allowed; use one of {expected}{hint}")
    if kind in _BOUNDS:
        op = _BOUNDS[kind]
        bound = next(iter((err.get("ctx") or {}).values()), "")
        own = field_bounds(info)
        # The field's own interval when this is one of its ends; an item's bound on its own.
        text = bounds_text(own) if op in own else bounds_text({op: bound})
        return ConfigError(f"{key}={value!r} must be {text}{hint}")
    if kind == "string_pattern_mismatch":
        return ConfigError(f"{key}={value!r} has the wrong form{hint}")
    if kind in ("too_short", "too_long"):
        return ConfigError(f"{key}={value!r} has the wrong number of items")
    problem = _PROBLEMS.get(kind.split("_")[0], err["msg"].lower())
    return ConfigError(f"{key}={value!r} {problem}{hint if kind == 'finite_number' else null}")
