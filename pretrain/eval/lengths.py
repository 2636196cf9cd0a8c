"""The values of length evaluation: `--lengths 1x,2x,8192`, `--rope-scaling yarn:4`, and the
checks they need (validation.evaluate_lengths runs them; pretrain/eval/positions.py measures)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import ConfigError, DataConfig, RopeScalingConfig, from_dict
from pretrain.errors import UserError


class LengthError(UserError, ValueError):
    """A --lengths, --depths, --stride or --rope-scaling value is wrong; the message says the
    fix."""


def parse_lengths(text: str, train_len: int, flag: str = "--lengths") -> list[int]:
    """'1x,2x,4x,8x' (multiples of the training length) and/or token counts ('4096'), sorted,
    each once."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            if part.lower().endswith("x"):
                value = float(part[:-1]) * train_len
                if not value.is_integer():
                    raise ValueError
                n = int(value)
            else:
                n = int(part)
        except ValueError:
            raise LengthError(
                f"{flag}: {part!r} is neither a multiple of the training length ('2x') nor a "
                f"number of tokens ('4096')"
            ) from None
        if n < 2:
            raise LengthError(f"{flag}: {part!r} is {n} tokens; a window needs at least 2")
        out.add(n)
    if not out:
        raise LengthError(f"{flag}: no lengths given; e.g. {flag} 1x,2x,4x,8x")
    return sorted(out)


def parse_rope_scaling(text: str | None, flag: str = "--rope-scaling") -> RopeScalingConfig | None:
    """'none', 'TYPE:FACTOR' ('yarn:4'), or a YAML mapping of model.rope_scaling's fields
    ('{type: yarn, factor: 4, original_max_seq_len: 2048}')."""
    if text is None or text.strip().lower() in ("", "none", "null"):
        return None
    text = text.strip()
    if ":" in text and not text.startswith("{"):
        kind, _, factor = text.partition(":")
        try:
            data = {"type": kind.strip(), "factor": float(factor)}
        except ValueError:
            raise LengthError(f"{flag} {text!r}: the factor {factor!r} is not a number") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
        if not isinstance(data, dict):
            raise LengthError(
                f"{flag} {text!r}: use TYPE:FACTOR (e.g. yarn:4) or a mapping such as "
                f"'{{type: yarn, factor: 4, original_max_seq_len: 2048}}'"
            )
    try:
        return from_dict(RopeScalingConfig, data, "rope_scaling")
    except ConfigError as e:
        raise LengthError(f"{flag}: {e}") from None


def scaling_tag(scaling: RopeScalingConfig | None) -> str:
    """The suffix that keeps a scaled evaluation's files apart from the unscaled ones
    (RUN/eval/step_0012000 and RUN/eval/step_0012000_yarn4): '' for none, TYPE + factor, and
    a short hash of the other fields where they are not the defaults."""
    if scaling is None:
        return ""
    tag = f"{scaling.type}{scaling.factor:g}".replace(".", "p")
    rest = {
        name: getattr(scaling, name)
        for name, f in type(scaling).model_fields.items()
        if name not in ("type", "factor") and getattr(scaling, name) != f.default
    }
    if rest:
        tag += "-" + hashlib.sha1(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:6]
    return tag


def check_lengths(model: Any, lengths: list[int], flag: str = "--lengths") -> None:
    """Learned positions cannot run past their table: one line instead of an index error."""
    table = model.max_positions
    if table is not None and max(lengths) > table:
        raise LengthError(
            f"{flag}: {max(lengths)} tokens is past the model's learned position table "
            f"({table} positions, model.learned_pos_emb): learned positions cannot be "
            f"evaluated past the length they were trained at; use lengths up to {table}"
        )


def train_length(config: dict[str, Any], model_max_seq_len: int) -> int:
    """The length the run trained at: train.seq_len, else model.max_seq_len."""
    return (config.get("train") or {}).get("seq_len") or model_max_seq_len


def valid_entries(config: dict[str, Any], valid_data: list[str] | None, where: Path) -> list[str]:
    if valid_data:
        return list(valid_data)
    data = from_dict(DataConfig, config.get("data"), "data")
    if not data.valid:
        raise LengthError(f"{where} has no data.valid; pass --val-data PREFIX_OR_FOLDER")
    return list(data.valid)
