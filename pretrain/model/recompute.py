"""Activation recompute (checkpointing) as a number of layers: none, all, some, or chosen by the planner.

`train.activation_checkpointing` takes
    false, "none", 0      keep every layer's activations for the backward (fastest, most memory)
    true, "full"          recompute every block in the backward (least memory, ~+30% FLOPs)
    N (1 .. n_layers)     recompute the first N blocks, keep the others
    "auto"                the planner (pretrain/planner/) picks the smallest N whose step fits
                          the GPU's memory, at start (docs/performance.md)

Why the *first* N: a block's saved activations live from its forward until its backward,
and the first blocks' live longest (their backward comes last). Recomputing those lowers the
peak at the start of the backward as much as any choice of N blocks, and every later
recompute happens when the kept blocks' activations are already freed, so it adds nothing
to that peak. Recomputing every k-th block costs the same FLOPs and peaks higher.
"""

from __future__ import annotations

from typing import Any

from pretrain.schema import ConfigError

KEY = "train.activation_checkpointing"
AUTO = "auto"
NAMES = ("none", "full", AUTO)


def recompute_layers(value: Any, n_layers: int, key: str = KEY) -> int | None:
    """The number of blocks to recompute for a config value; None for "auto".

    Raises ConfigError naming `key` and the accepted values for anything else.
    """
    if isinstance(value, bool):
        return n_layers if value else 0
    if isinstance(value, int):
        if not 0 <= value <= n_layers:
            raise ConfigError(
                f"{key}={value} is not a number of layers of this model (model.n_layers="
                f"{n_layers}); use 0..{n_layers}, 'none', 'full' or 'auto'"
            )
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "none":
            return 0
        if text == "full":
            return n_layers
        if text == AUTO:
            return None
    raise ConfigError(
        f"{key}={value!r} is not allowed; use false/'none', true/'full', a number of layers "
        f"(0..{n_layers}) or 'auto' (the planner picks the least recompute that fits)"
    )


def check_recompute(cfg: Any) -> None:
    """Validate `cfg.train.activation_checkpointing` against `cfg.model.n_layers`."""
    recompute_layers(cfg.train.activation_checkpointing, cfg.model.n_layers)


def describe_recompute(layers: int, n_layers: int) -> str:
    """'none', 'full (16 of 16 layers)' or '6 of 16 layers'."""
    if layers <= 0:
        return "none"
    if layers >= n_layers:
        return f"full ({n_layers} of {n_layers} layers)"
    return f"{layers} of {n_layers} layers"
