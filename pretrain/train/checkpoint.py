"""Checkpoints that survive being killed at any moment, and auto-resume.

One checkpoint is a folder RUN/checkpoints/step_0001000/ (names: pretrain/run_layout.py) holding
    DeepSpeed's files            model, optimizer (ZeRO shards), LR scheduler
    rng/rank_00000.pt ...        python, numpy and torch RNG states of every rank
    trainer_state.json           step, samples and tokens consumed, data position, the
                                 resolved config, spike-detector window (written last)
    model.safetensors            consolidated weights, the run config, tokenizer/: a weights
                                 folder that evaluation and export read without DeepSpeed

How a kill cannot break it: everything is written into step_0001000.tmp/, fsynced, and
only then renamed to step_0001000/ (an atomic rename); `latest` is rewritten through a
temporary file and os.replace. A folder without `.tmp` is therefore complete. Retention
renames old folders to `.deleting` before removing them, so a kill during removal leaves
nothing that looks complete. Loading takes the tag in `latest` if it is complete, else
the newest complete folder; leftovers (`*.tmp`, `*.deleting`) are cleaned at start.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.run_layout import (
    DELETING_SUFFIX,
    LATEST_FILE,
    RNG_DIR,
    STATE_FILE,
    TMP_SUFFIX,
    atomic_write,
    step_tag,
)
from pretrain.train.distributed import barrier

# Fault-injection hook for tests, "STEP:SECONDS": when saving STEP, rank 0 waits after the
# files are written and before the folder is committed, so a test can kill it mid-save.
_PAUSE_ENV = "PRETRAIN_TEST_PAUSE_BEFORE_COMMIT"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(folder: Path) -> bool:
    return (
        folder.is_dir()
        and folder.name.startswith("step_")
        and not folder.name.endswith((TMP_SUFFIX, DELETING_SUFFIX))
        and (folder / STATE_FILE).is_file()
    )


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint tags, oldest first (tags sort by step)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if is_complete(p))


def find_resume_tag(ckpt_dir: Path) -> str | None:
    """The tag in `latest` when that checkpoint is complete, else the newest complete one."""
    latest = ckpt_dir / LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag and is_complete(ckpt_dir / tag):
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def read_state(folder: Path) -> dict[str, Any]:
    """trainer_state.json of a complete checkpoint folder."""
    return json.loads((Path(folder) / STATE_FILE).read_text())


def clean_leftovers(ckpt_dir: Path) -> None:
    """Remove half-written (`.tmp`) and half-deleted (`.deleting`) folders (rank 0, at start)."""
    if not ckpt_dir.is_dir():
        return
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save/load through a DeepSpeed engine; rank 0 owns the folder operations."""

    def __init__(self, ckpt_dir: Path, keep_last: int, rank: int, world_size: int):
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.dir)
        barrier()

    def save(self, engine, step: int, state: dict[str, Any], write_weights) -> Path:
        """Write checkpoint `step`; `write_weights(folder)` adds the weights-folder files (rank 0).

        Every rank must call it. Returns the final folder.
        """
        tag = step_tag(step)
        final = self.dir / tag
        tmp = self.dir / (tag + TMP_SUFFIX)
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        barrier()
        engine.save_checkpoint(str(self.dir), tag=tmp.name, client_state={}, save_latest=False)
        (tmp / RNG_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), tmp / RNG_DIR / f"rank_{self.rank:05d}.pt")
        barrier()
        if self.rank == 0:
            write_weights(tmp)
            state = {**state, "step": step, "world_size": self.world_size, "saved_at": time.time()}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            _fsync_tree(tmp)
            pause_step, _, pause_s = os.environ.get(_PAUSE_ENV, "").partition(":")
            if pause_step and int(pause_step) == step:
                print(f"[test] pausing {pause_s}s before committing {tag}", flush=True)
                time.sleep(float(pause_s))
            if final.exists():  # the same step saved again (e.g. after a resume): replace it
                old = self.dir / (tag + DELETING_SUFFIX)
                os.rename(final, old)
                shutil.rmtree(old)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            atomic_write(self.dir / LATEST_FILE, tag)
            self._retain()
        barrier()
        return final

    def _retain(self) -> None:
        tags = complete_tags(self.dir)
        for tag in tags[: max(0, len(tags) - self.keep_last)]:
            doomed = self.dir / (tag + DELETING_SUFFIX)
            os.rename(self.dir / tag, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def load(self, engine, tag: str) -> dict[str, Any]:
        """Restore engine (model, optimizer, scheduler), this rank's RNG; return trainer state."""
        folder = self.dir / tag
        state = read_state(folder)
        path, _ = engine.load_checkpoint(
            str(self.dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder}")
        rng_file = folder / RNG_DIR / f"rank_{self.rank:05d}.pt"
        if rng_file.is_file() and state.get("world_size") == self.world_size:
            set_rng_state(torch.load(rng_file, weights_only=False))
        elif self.rank == 0:
            print(
                f"warning: {folder} was written by {state.get('world_size')} ranks, this run has "
                f"{self.world_size}; random states start afresh (data order is unaffected)"
            )
        return state
