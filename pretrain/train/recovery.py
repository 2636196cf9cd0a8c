"""Where a run goes back to: the checkpoint a resume or a loss-spike rollback restores.

The loop (trainer.py) calls these and restores the checkpoint they choose; they decide, check
and explain (which tag, which data to skip, which checkpoints a rollback made stale), so the
loop's own methods stay a few lines long.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import Config, ConfigError, ModelConfig, to_dict
from pretrain.run_layout import ROLLBACKS_FILE, RunLayout, tag_step
from pretrain.train import distributed as dist_utils
from pretrain.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    complete_tags,
    find_resume_tag,
    read_state,
)
from pretrain.train.spikes import DataWindows, Rollback, write_rollbacks

Log = Callable[[str], None]


def config_changes(a: Any, b: Any, prefix: str = "") -> list[str]:
    """'key old -> new' for every leaf that differs between two config dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += config_changes(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [f"{prefix} {a!r} -> {b!r}"]


def warn_config_changes(layout: RunLayout, resolved: dict[str, Any], log: Log) -> None:
    """On a re-run, say which settings differ from the run config saved by the last one."""
    if layout.config.is_file():
        changed = config_changes(yaml.safe_load(layout.config.read_text()) or {}, resolved)
        if changed:
            log("warning: config differs from the saved run config: " + ", ".join(changed))


def check_same_model(folder: Path, resolved: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint of another model (a field added since the checkpoint
    was written counts as its default)."""
    saved = read_state(folder).get("config", {}).get("model", {})
    saved = {**to_dict(ModelConfig()), **saved}
    changed = config_changes(saved, resolved["model"], "model")
    if changed:
        raise ConfigError(
            f"{folder} holds a different model ({'; '.join(changed)}); use a new "
            f"logging.run_dir, or --set checkpoint.resume=false to start this run over"
        )


def drop_stale_checkpoints(
    layout: RunLayout,
    checkpointer: Checkpointer,
    rollbacks: list[Rollback],
    is_main: bool,
    log: Log,
) -> None:
    """Delete the checkpoints a rollback went back past: written after its first spike and
    before it (their `rollbacks` count is lower than its index). Idempotent, so a resume
    after a kill in the middle of a rollback finishes it."""
    if is_main:
        for tag in complete_tags(layout.checkpoints):
            done = read_state(layout.checkpoints / tag).get("rollbacks", 0)
            if any(tag_step(tag) > r.to_step and done < r.index for r in rollbacks):
                log(f"removing checkpoint {tag}: it is past a rollback")
                checkpointer.discard(tag)
    dist_utils.barrier()


def plan_rollback(
    cfg: Config,
    layout: RunLayout,
    env: dist_utils.DistEnv,
    rollbacks: list[Rollback],
    at: tuple[int, int],
    first: tuple[int, int],
    log: Log,
) -> tuple[Rollback, str] | None:
    """(record, checkpoint tag) of a rollback at `at` = (step, the data step that completed the
    episode) for a run of spikes starting at `first` = (step, data step): back to the newest
    intact checkpoint before the first spike, never to train on the data from the first
    spike's data step - rollback_skip_before to the completing one + rollback_skip_after. None, with a warning, when
    spikes.max_rollbacks is reached or no checkpoint is old enough."""
    c, (step, last_data_step), (first_step, first_data_step) = cfg.spikes, at, first
    if len(rollbacks) >= c.max_rollbacks:
        log(
            f"warning: not rolling back at step {step}: spikes.max_rollbacks={c.max_rollbacks} "
            f"reached; flagged steps are still skipped when spikes.skip_step is on"
        )
        return None
    try:
        tag = find_resume_tag(
            layout.checkpoints, cfg.checkpoint.verify, env.rank, env.world_size, before=first_step
        )
    except CheckpointError:  # all damaged (each named in a warning above)
        tag = None
    if tag is None:
        log(
            f"warning: cannot roll back at step {step}: no intact checkpoint before the first "
            f"spike (step {first_step}); save more often (checkpoint.interval) or keep more "
            f"(checkpoint.keep_last)"
        )
        return None
    gbs = cfg.train.global_batch_size
    resume_data_step = read_state(layout.checkpoints / tag)["consumed_samples"] // gbs + 1
    skip = (
        max(resume_data_step, first_data_step - c.rollback_skip_before),
        last_data_step + c.rollback_skip_after,
    )
    record = Rollback(len(rollbacks) + 1, step, tag_step(tag), first_step, skip)
    log(
        f"warning: rollback {record.index}: {c.rollback_after} of the last "
        f"{c.rollback_within} steps were spikes (the first at step {first_step}); back to "
        f"checkpoint {tag} (step {record.to_step}), never training on data steps "
        f"{skip[0]}-{skip[1]}"
    )
    return record, tag


def record_rollback(
    layout: RunLayout, rollbacks: list[Rollback], record: Rollback, is_main: bool
) -> None:
    """Write the rollback into the run's rollbacks.json (rank 0), then every rank appends it:
    from here on, a resume finishes this rollback instead of repeating the spikes."""
    if is_main:
        write_rollbacks(layout.root, [*rollbacks, record])
    dist_utils.barrier()
    rollbacks.append(record)


def next_data_step(
    cfg: Config, consumed: int, rollbacks: list[Rollback], layout: RunLayout, log: Log
) -> int:
    """The data step the next optimizer step reads: the one after `consumed` samples, or the
    first past a skipped window (spikes.skip_data and every rollback's)."""
    gbs = cfg.train.global_batch_size
    windows = DataWindows([*cfg.spikes.skip_data, *(r.skip for r in rollbacks)])
    data_step = windows.next_data_step(consumed // gbs + 1)
    if data_step != consumed // gbs + 1:
        log(
            f"skipping data steps {consumed // gbs + 1}-{data_step - 1} "
            f"(spikes.skip_data, {layout.root / ROLLBACKS_FILE})"
        )
    return data_step


def trainer_state(cfg, consumed: int, callbacks, module, rollbacks: list, resolved: dict) -> dict:
    """What a checkpoint holds of the trainer beside DeepSpeed's files: the data position,
    the callbacks' states (by state_key), the spike guard's history (every step taken
    judged first), the rollbacks before it, the resolved config. `saved_states` reads it."""
    return {
        "consumed_samples": consumed,
        "consumed_tokens": consumed * cfg.seq_len,
        "data": {"consumed_samples": consumed, "train": list(cfg.data.train)},
        "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks if cb.state_key},
        "spike_guard": module.state_dict(),
        "rollbacks": len(rollbacks),  # rollbacks before it (see drop_stale_checkpoints)
        "config": resolved,
    }


def saved_states(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(spike guard state, callbacks' states by state_key) of a checkpoint's trainer state,
    also from checkpoints written before callbacks had state."""
    callbacks = state.get("callbacks", {})
    if "spike_detector" in state:
        callbacks.setdefault("spikes", state["spike_detector"])
    return state.get("spike_guard", callbacks.get("spikes", {})), callbacks
