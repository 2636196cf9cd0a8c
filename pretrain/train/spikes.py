"""Loss spikes: detect them, skip their update, roll back past them and skip their data.

    SpikeDetector   robust z-score (rolling median / MAD) of one series: loss or grad norm
    StepGuard       judges each step inside DeepSpeed's step, after the gradient norm is known
                    and before the update, and skips the update when asked (spikes.skip_step);
                    without skip_step, once the step's values are read; notes a run of
                    flagged steps that calls for a rollback (spikes.rollback_after)
    SkipStepOptimizer  the optimizer wrapper DeepSpeed steps, through which the guard skips
    Unjudged        a step's values, still on the device, that the guard judges later
    Rollback        a rollback: the step it happened at, the checkpoint it went back to, and the
                    data steps it skipped; kept in RUN/rollbacks.json, so a resume skips them too
    DataWindows     the data steps a run never trains on (spikes.skip_data and every rollback's)

The trainer (pretrain/train/trainer.py) drives them; their scalars and lines go with each
step's values to the sinks (pretrain/train/metrics.py spike_report, pretrain/train/sinks.py).

A "data step" numbers the batches of the data stream: data step s is the batch that step s
reads when no data is skipped. Skipping a data window moves every later step forward in the
stream; nothing else about the data order changes.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch

from pretrain.config import SpikesConfig
from pretrain.run_layout import ROLLBACKS_FILE, atomic_write
from pretrain.train.deepspeed_adapter import (
    OptimizerWrapper,
    advance_schedule,
    inner_optimizer,
    wrap_stepped_optimizer,
)

# MAD of a normal distribution is 0.6745 sigma: scaling by 1.4826 makes the robust score
# comparable to a z-score.
MAD_TO_SIGMA = 1.4826


@dataclass
class Spike:
    step: int
    value: float
    expected: float  # median of the window
    score: float  # (value - median) / (1.4826 * MAD); inf for NaN/Inf


class SpikeDetector:
    """Flags a value far above the recent ones, robustly: rolling median and MAD.

    A z-score on mean and standard deviation is dragged by the spikes it should find; the
    median and the median absolute deviation are not (until half the window is spikes, so
    a lasting level change becomes the new normal after window / 2 steps). The window holds
    the last `window` finite values; nothing is flagged before it holds `min_history`. A
    non-finite value is always a spike. `last_score` is the latest value's score (None while
    the window is short).
    """

    def __init__(self, window: int = 100, threshold: float = 6.0, min_history: int | None = None):
        self.window = window
        self.threshold = threshold
        self.min_history = min_history if min_history is not None else max(10, window // 4)
        self.history: deque[float] = deque(maxlen=window)
        self.last_score: float | None = None

    def score(self, value: float) -> tuple[float, float] | None:
        """(robust z-score, median) of `value` against the window; None while it is short."""
        if not math.isfinite(value):
            return float("inf"), median(self.history) if self.history else float("nan")
        if len(self.history) < self.min_history:
            return None
        med = median(self.history)
        mad = median(abs(x - med) for x in self.history)
        # A floor on the spread keeps a perfectly flat window from flagging rounding noise.
        scale = MAD_TO_SIGMA * max(mad, 1e-3 * abs(med), 1e-8)
        return (value - med) / scale, med

    def update(self, step: int, value: float) -> Spike | None:
        scored = self.score(value)
        self.last_score = None if scored is None else scored[0]
        spike = None
        if scored is not None and scored[0] > self.threshold:
            spike = Spike(step, value, scored[1], scored[0])
        if math.isfinite(value):
            self.history.append(value)
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))


@dataclass
class Verdict:
    """What the guard decided about one step."""

    step: int
    data_step: int
    loss: float
    grad_norm: float | None  # before clipping; None where DeepSpeed reports none
    loss_score: float | None = None  # robust z-scores (None while the window is short)
    grad_score: float | None = None
    loss_spike: Spike | None = None
    grad_spike: Spike | None = None
    skipped: bool = False  # no update was applied
    reason: str = ""  # why it was flagged, for the log
    skipped_total: int = 0  # skipped steps in the run's history, this one included

    @property
    def flagged(self) -> bool:
        return self.loss_spike is not None or self.grad_spike is not None


@dataclass
class Unjudged:
    """A step the guard has not judged yet. Its loss and gradient norm are the step's
    recorded values (StepMetrics), judged once they are read (`StepGuard.judge`)."""

    step: int
    data_step: int
    skipped_by_deepspeed: bool


def _host(value: Any) -> float | None:
    """A float of a device scalar (a read that waits for the GPU), a float or None."""
    return None if value is None else float(value)


def _inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer that applies the update (tests read its state through this)."""
    return inner_optimizer(engine)


class SkipStepOptimizer(OptimizerWrapper):
    """The torch optimizer DeepSpeed steps, wrapped so that a step can be withheld (as
    OLMo-core's SkipStepOptimizer), installed by build_engine through
    deepspeed_adapter.wrap_stepped_optimizer. Armed for a boundary step (`arm`), it reads the
    global gradient norm at DeepSpeed's call of its `step`, once the norm is known and
    before anything changed (`grad_norm`, the adapter's reader), and asks `judge(norm)`, when
    given one, whether to skip; a skipped call steps nothing. `disarm` says whether DeepSpeed
    called it and with what norm. Unarmed, it is the inner optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_norm: Callable[[], Any]) -> None:
        super().__init__(optimizer)
        self.grad_norm = grad_norm
        self.armed = False
        self.judge: Callable[[Any], bool] | None = None  # None: read the norm, never skip
        self.norm: Any = None  # the step's norm, as DeepSpeed left it
        self.called = False  # DeepSpeed called the step (it did not skip it itself)
        self.skipping = False

    def arm(self, judge: Callable[[Any], bool] | None = None) -> None:
        self.armed, self.judge, self.norm = True, judge, None
        self.called = self.skipping = False

    def disarm(self) -> tuple[bool, Any]:
        """(whether DeepSpeed called the step, the step's gradient norm); then forgets both."""
        out = self.called, self.norm
        self.armed, self.judge, self.norm = False, None, None
        self.called = self.skipping = False
        return out

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # ZeRO steps once per parameter group: the step is judged at the first call.
        if self.armed and not self.called:
            self.called, self.norm = True, self.grad_norm()
            if self.judge is not None:
                self.skipping = self.judge(self.norm)
        if self.skipping:
            return None
        return super().step(closure)


class StepGuard:
    """Judges every step from its all-reduced loss and DeepSpeed's global gradient norm,
    withholds a flagged step's update when `spikes.skip_step` is on, and says when a run of
    flagged steps calls for a rollback (`spikes.rollback_after`).

    Why inside the optimizer: DeepSpeed computes the gradient norm in its own step, then clips
    and calls the inner torch optimizer, then copies the fp32 master weights to the bf16 ones.
    The guard talks to the SkipStepOptimizer in the inner optimizer's place: judged there, the
    norm is known and nothing has changed yet; a skipped call leaves the master weights, the
    moments and the per-parameter step counts as they were, and the copy back writes the same
    bf16 weights. That holds for ZeRO 0, 1 and 2 in fp32 and bf16 (tests/test_train_spikes.py
    compares the state bit for bit). Where DeepSpeed skips a non-finite gradient by itself
    (its overflow checks) it never calls the inner optimizer; the guard then records a skip
    with an infinite norm.

    With skip_step on, the LR schedule moves on over a skipped step (DeepSpeed steps it; where
    DeepSpeed skipped the step itself, the guard steps it): the schedule follows the step
    number, so the run still ends at train_iters at the final LR, and a skipped step costs its
    batch. With it off, nothing changes: DeepSpeed's own skips of non-finite gradients hold the
    schedule, as they always did.

    When a verdict is needed. Only skip_step needs it inside the step, before the update
    (`synchronous`): the guard is then handed the step's all-reduced loss and reads it and the
    norm on the host inside the step (a wait for the GPU; where DeepSpeed has just waited for
    its own overflow check, bf16 and fp32 ZeRO 1/2, one that costs nothing more). Otherwise
    (the default) the guard holds nothing of the step: `guarded_step` returns an `Unjudged`,
    and `judge` turns the step's recorded loss and norm into the verdict once they are read
    (StepMetrics.read, once per log interval) and handed to it (TrainModule.settle), in step
    order: the same detector inputs in the same order, so the same verdicts. A rollback is
    decided there too, at the flush: `judge` notes the episode when it completes, and the
    trainer rolls back after the flush (its data window is the one the step that completed
    the episode sets, so a later decision skips the same data). Deciding a skip on the device
    instead (a 0/1 tensor gating the update, as GradScaler's found_inf gates torch's fused
    AdamW) would save no wait while DeepSpeed reads its own overflow flag on the host in the
    same step.
    """

    def __init__(self, cfg: SpikesConfig, world_size: int = 1):
        self.cfg = cfg
        self.world_size = world_size
        self.loss = SpikeDetector(cfg.window, cfg.threshold)
        self.grad_norm = SpikeDetector(cfg.window, cfg.grad_norm_threshold)
        # (step, data step) of the flagged steps within the last rollback_within steps
        self.flagged_steps: deque[tuple[int, int]] = deque()
        # (first flagged step, its data step, the data step that completed the episode)
        self.episode: tuple[int, int, int] | None = None
        self.skipped_total = 0  # skipped steps in the run's history
        self._engine: Any = None
        self._optimizer: SkipStepOptimizer | None = None

    @property
    def synchronous(self) -> bool:
        """Whether each step is judged inside it (see the class docstring)."""
        return bool(self.cfg.skip_step)

    def install(self, engine) -> None:
        """Talk to the engine's SkipStepOptimizer (build_engine put it in; an engine built
        otherwise gets one here)."""
        optimizer = wrap_stepped_optimizer(engine, SkipStepOptimizer)
        if not isinstance(optimizer, SkipStepOptimizer):
            raise TypeError(f"the engine steps a {type(optimizer).__name__}, not a guard's")
        self._engine, self._optimizer = engine, optimizer

    def guarded_step(
        self, step: int, data_step: int, loss: Any, run_step: Callable[[], None]
    ) -> tuple[Verdict | Unjudged, Any]:
        """The engine's boundary step (`run_step`) under the guard: (the verdict when
        `synchronous`, else the step for `judge`; the step's gradient norm as DeepSpeed left
        it: a device tensor, a float, inf where DeepSpeed skipped the update, None where it
        reports none). `loss`: the step's all-reduced loss, read only when `synchronous`."""
        verdict: Verdict | None = None

        def judge(norm: Any) -> bool:
            nonlocal verdict
            verdict = self._judge(step, data_step, float(loss), _host(norm))
            return verdict.skipped

        self._optimizer.arm(judge if self.synchronous else None)
        try:
            run_step()
        finally:
            called, norm = self._optimizer.disarm()
        skipped = not called  # DeepSpeed skipped the update itself: non-finite gradients
        norm = float("inf") if skipped else norm
        if not self.synchronous:
            return Unjudged(step, data_step, skipped), norm
        if verdict is None:  # DeepSpeed skipped before calling the optimizer
            verdict = self._judge(step, data_step, float(loss), norm, skipped)
            advance_schedule(self._engine)  # DeepSpeed holds the schedule; we do not
        return verdict, norm

    def judge(self, step: Unjudged, loss: float, grad_norm: float | None) -> Verdict:
        """The verdict of an unjudged step, given its loss and grad norm read on the host.
        Steps must come in order (the detectors' windows)."""
        return self._judge(step.step, step.data_step, loss, grad_norm, step.skipped_by_deepspeed)

    def _judge(
        self,
        step: int,
        data_step: int,
        loss: float,
        grad_norm: float | None,
        skipped_by_deepspeed: bool = False,
    ) -> Verdict:
        v = Verdict(step, data_step, loss, grad_norm)
        v.loss_spike = self.loss.update(step, loss)
        v.loss_score = self.loss.last_score
        if grad_norm is not None:
            v.grad_spike = self.grad_norm.update(step, grad_norm)
            v.grad_score = self.grad_norm.last_score
        skip = skipped_by_deepspeed or (self.cfg.skip_step and v.flagged)
        if self.cfg.skip_step and self.world_size > 1:
            # The inputs are the same on every rank by construction (an all-reduced loss, a
            # global norm); one scalar more makes a disagreement impossible, not just unlikely.
            flag = torch.tensor([float(skip)], device=self._device())
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            skip = bool(flag.item())
        v.skipped = skip
        reasons = []
        if v.loss_spike is not None:
            reasons.append(f"loss {loss:.4f} (expected {v.loss_spike.expected:.4f})")
        if v.grad_spike is not None:
            reasons.append(f"grad norm {grad_norm:.4g} (expected {v.grad_spike.expected:.4g})")
        if skipped_by_deepspeed:
            reasons.append("non-finite gradients")
        v.reason = ", ".join(reasons)
        if v.flagged or skip:
            self.flagged_steps.append((step, data_step))
            self._note_episode(step, data_step)
        self.skipped_total += skip
        v.skipped_total = self.skipped_total
        return v

    def _device(self) -> torch.device:
        return next(self._engine.module.parameters()).device

    def _note_episode(self, step: int, data_step: int) -> None:
        """An episode completes when rollback_after of the last rollback_within steps, this
        one included, were flagged; it stands until a rollback answers it."""
        c = self.cfg
        while self.flagged_steps and self.flagged_steps[0][0] <= step - c.rollback_within:
            self.flagged_steps.popleft()
        due = c.rollback_after and len(self.flagged_steps) >= c.rollback_after
        if due and self.episode is None:
            self.episode = (*self.flagged_steps[0], data_step)

    def forget_flags(self) -> None:
        """A rollback answered the episode: its flagged steps no longer count towards another."""
        self.flagged_steps.clear()
        self.episode = None

    def rollback_due(self) -> tuple[int, int, int] | None:
        """(first flagged step, its data step, the data step that completed the episode) of
        a run of spikes judged so far that calls for a rollback; else None."""
        return self.episode

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss.state_dict(),
            "grad_norm": self.grad_norm.state_dict(),
            "flagged_steps": [list(f) for f in self.flagged_steps],
            "episode": list(self.episode) if self.episode else None,
            "skipped_total": self.skipped_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "history" in state:  # checkpoints from before grad-norm detection: the loss only
            state = {"loss": state}
        self.loss.load_state_dict(state.get("loss", {}))
        self.grad_norm.load_state_dict(state.get("grad_norm", {}))
        self.flagged_steps = deque(tuple(f) for f in state.get("flagged_steps", []))
        episode = state.get("episode")
        self.episode = tuple(episode) if episode else None
        self.skipped_total = state.get("skipped_total", 0)


# ----------------------------------------------------------------------------- rollbacks


@dataclass
class Rollback:
    """One rollback: at `at_step` the run went back to checkpoint `to_step` and skipped data
    steps `skip` ([first, last], inclusive). `index` counts the run's rollbacks from 1."""

    index: int
    at_step: int
    to_step: int
    first_spike: int
    skip: tuple[int, int]
    time: float = field(default_factory=time.time)


def read_rollbacks(run_dir: Path) -> list[Rollback]:
    path = Path(run_dir) / ROLLBACKS_FILE
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())
    return [Rollback(**{**r, "skip": tuple(r["skip"])}) for r in rows]


def write_rollbacks(run_dir: Path, rollbacks: list[Rollback]) -> None:
    """Atomic and fsynced: written before the rollback acts, so a kill at any point after
    it resumes into the same rollback."""
    atomic_write(
        Path(run_dir) / ROLLBACKS_FILE, json.dumps([asdict(r) for r in rollbacks], indent=1)
    )


class DataWindows:
    """Data steps never trained on: [first, last] windows, inclusive, 1-based."""

    def __init__(self, windows: list[tuple[int, int]]):
        self.windows = sorted((int(a), int(b)) for a, b in windows)

    def next_data_step(self, data_step: int) -> int:
        """The first data step at or after `data_step` outside every window."""
        moved = True
        while moved:
            moved = False
            for a, b in self.windows:
                if a <= data_step <= b:
                    data_step, moved = b + 1, True
        return data_step
