"""Command-line values of length evaluation: `--lengths 1x,2x,8192` and `--rope-scaling yarn:4`."""

from __future__ import annotations

import yaml

from pretrain.config import ConfigError, RopeScalingConfig, from_dict
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


__all__ = ["LengthError", "parse_lengths", "parse_rope_scaling"]
