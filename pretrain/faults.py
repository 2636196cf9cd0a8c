"""Fault injection, in one place: what tests and demos break on purpose, and where.

Two kinds:

- **Process faults** for the crash-safety tests: `fault_point(name, step)` marks a point of
  the code where a test may kill the process (as `kill -9` would: no clean-up) or pause it
  (so the test can send a signal at a known moment). The tests choose the point through
  environment variables; production runs never set them, and this is the only module that
  reads them:
      PRETRAIN_TEST_KILL_AT=POINT:STEP        die at POINT while at STEP (POINT alone: any step)
      PRETRAIN_TEST_PAUSE_AT=POINT:STEP:SECS  sleep SECS at POINT while at STEP
      PRETRAIN_TEST_FAIL_AT=POINT:STEP        raise OSError(ENOSPC) there, as a full disk would
  Points: the phases of a checkpoint save (SAVE_POINTS; with checkpoint.async they run in
  the writer thread, and dying there kills the process), of a rollback (ROLLBACK_POINTS),
  the units a data preparation has written (PREPARE_POINTS; its STEP is the unit count), and
  a checkpoint's re-partitioning for another number of ranks (RESHARD_POINTS).
  This module sits at the base, beside the config, so that data/ and train/ both use it.
- **Step faults** from the config (`spikes.faults`, pretrain/config.py FaultConfig), by data
  step (`DataFaults`): a batch corrupted so that the loss-spike guard has something to
  catch (on every rank, or on one), and one rank that hangs or is slow, for the hang watchdog and the straggler scalar
  (pretrain/train/watchdog.py). A hang fires once per run folder: before blocking, the rank
  leaves a marker in RUN/hang/, and a rerun of the run (a requeued job) trains through.
"""

from __future__ import annotations

import errno
import os
import time

import torch

from pretrain.config import FaultConfig
from pretrain.exit_codes import EXIT_KILLED
from pretrain.run_layout import RunLayout, atomic_write

KILL_ENV = "PRETRAIN_TEST_KILL_AT"
PAUSE_ENV = "PRETRAIN_TEST_PAUSE_AT"
FAIL_ENV = "PRETRAIN_TEST_FAIL_AT"
SAVE_POINTS = (
    "async_write",  # checkpoint.async: in the writer thread, DeepSpeed's files of this rank written
    "after_engine_save",
    "after_weights",
    "mid_marker",
    "before_commit",
    "before_latest",
    "before_retention",
)
ROLLBACK_POINTS = ("rollback_recorded", "rollback_done")
PREPARE_POINTS = ("prepare_units_written",)
RESHARD_POINTS = ("universal_converted",)  # converted, before its marker and rename
POINTS = SAVE_POINTS + ROLLBACK_POINTS + PREPARE_POINTS + RESHARD_POINTS


def kill_requested(name: str, step: int) -> bool:
    """True when a test asked to die at `name` while at `step` (for a point that must do
    something first, e.g. write half a file); `fault_point` kills by itself."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; the points are {', '.join(POINTS)}")
    return os.environ.get(KILL_ENV, "") in (name, f"{name}:{step}")


def die() -> None:
    """Exit at once, as kill -9 would: no finally blocks, no atexit, no flushed buffers."""
    os._exit(EXIT_KILLED)


def fault_point(name: str, step: int) -> None:
    """Die, fail or pause here when a test asks for this point at this step; nothing
    otherwise."""
    if kill_requested(name, step):
        die()
    if os.environ.get(FAIL_ENV, "") in (name, f"{name}:{step}"):
        raise OSError(errno.ENOSPC, f"No space left on device ({FAIL_ENV}={name}:{step})")
    point, _, rest = os.environ.get(PAUSE_ENV, "").partition(":")
    at, _, seconds = rest.partition(":")
    if point == name and at == str(step):
        print(f"[test] pausing {seconds}s at {name} (step {step})", flush=True)
        time.sleep(float(seconds))


def block_forever() -> None:
    """What a hung rank does: never return (the main thread sleeps; other threads run)."""
    while True:
        time.sleep(3600)


class DataFaults:
    """The config's `spikes.faults`, by data step: which corruption a micro batch gets, and
    whether this rank stalls before it. `layout` is the run folder, where a hang fault that
    fired leaves its marker."""

    def __init__(
        self,
        faults: list[FaultConfig],
        seed: int,
        vocab_size: int,
        rank: int,
        layout: RunLayout | None = None,
    ):
        def steps(f: FaultConfig) -> range:
            return range(f.step, (f.last or f.step) + 1)

        rank_kinds = ("hang", "slow")
        self.by_step = {
            s: f
            for f in faults
            if f.kind not in rank_kinds and f.rank in (None, rank)
            for s in steps(f)
        }
        self.stalls = {
            s: f for f in faults if f.kind in rank_kinds and f.rank == rank for s in steps(f)
        }
        self.seed, self.vocab_size, self.rank = seed, vocab_size, rank
        self.layout = layout

    def stall(self, data_step: int, micro: int) -> None:
        """Before the first micro batch of a data step: a slow fault of this rank sleeps its
        seconds; a hang fault blocks for good, unless it fired before in this run folder."""
        fault = self.stalls.get(data_step)
        if fault is None or micro:
            return
        if fault.kind == "slow":
            time.sleep(fault.seconds or 0.0)
            return
        if self.layout is not None:
            marker = self.layout.injected_hang(self.rank, data_step)
            if marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(marker, "a hang fault (spikes.faults) fired; it fires once per run\n")
        print(
            f"[fault] rank {self.rank} hangs at data step {data_step} (spikes.faults)", flush=True
        )
        block_forever()

    def batch(
        self, x: torch.Tensor, y: torch.Tensor, data_step: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro batch as the step trains on it: uniformly random token ids in place of
        the data for a `noise` fault (the same for a data step on every run of the config)."""
        fault = self.by_step.get(data_step)
        if fault is None or fault.kind != "noise":
            return x, y
        g = torch.Generator().manual_seed(hash((self.seed, data_step, micro, self.rank)) % 2**63)
        seq = torch.randint(0, self.vocab_size, (x.shape[0], x.shape[1] + 1), generator=g)
        return seq[:, :-1].to(x.device), seq[:, 1:].to(x.device)

    def loss(self, loss: torch.Tensor, data_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss as reported, objective the backward differentiates) under the step's fault:
        nan spoils both, scale_loss scales both, scale_grads only the objective, inf_grads
        makes the objective's gradients infinite (NaN where they were 0), as an overflow
        would."""
        fault = self.by_step.get(data_step)
        if fault is None or fault.kind == "noise":
            return loss, loss
        if fault.kind == "nan":
            loss = loss * float("nan")
            return loss, loss
        if fault.kind == "scale_loss":
            loss = loss * fault.factor
            return loss, loss
        if fault.kind == "inf_grads":
            return loss, loss * float("inf")
        return loss, loss * fault.factor  # scale_grads
