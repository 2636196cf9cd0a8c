"""Loss spikes: a robust detector over a rolling window of the step losses."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Any

from pretrain.train.callbacks.base import Callback, StepOutput

# MAD of a normal distribution is 0.6745 sigma: scaling by 1.4826 makes the robust score
# comparable to a z-score.
MAD_TO_SIGMA = 1.4826


@dataclass
class Spike:
    step: int
    loss: float
    expected: float  # median of the window
    score: float  # (loss - median) / (1.4826 * MAD)


class SpikeDetector:
    """Flags a loss far above the recent ones, robustly: rolling median and MAD.

    A z-score on mean and standard deviation is dragged by the spikes it should find; the
    median and the median absolute deviation are not (until half the window is spikes, so
    a lasting level change becomes the new normal after window / 2 steps). The window holds
    the last `window` finite losses; nothing is flagged before it holds `min_history`.
    A non-finite loss is always a spike.
    """

    def __init__(self, window: int = 100, threshold: float = 6.0, min_history: int | None = None):
        self.window = window
        self.threshold = threshold
        self.min_history = min_history if min_history is not None else max(10, window // 4)
        self.history: deque[float] = deque(maxlen=window)

    def update(self, step: int, loss: float) -> Spike | None:
        spike = None
        if not math.isfinite(loss):
            spike = Spike(
                step, loss, median(self.history) if self.history else float("nan"), float("inf")
            )
        elif len(self.history) >= self.min_history:
            med = median(self.history)
            mad = median(abs(x - med) for x in self.history)
            # A floor on the spread keeps a perfectly flat window from flagging rounding noise.
            scale = MAD_TO_SIGMA * max(mad, 1e-3 * abs(med), 1e-8)
            score = (loss - med) / scale
            if score > self.threshold:
                spike = Spike(step, loss, med, score)
        if math.isfinite(loss):
            self.history.append(loss)
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))


class SpikeMonitor(Callback):
    """spikes/* scalars, a text event and a console warning for every loss spike. The
    decision uses the all-reduced loss, so every rank sees the same spikes."""

    state_key = "spikes"

    def __init__(self, window: int = 100, threshold: float = 6.0) -> None:
        self.detector = SpikeDetector(window, threshold)

    def on_step_end(self, trainer, out: StepOutput) -> None:
        spike = self.detector.update(out.step, out.loss)
        if spike is None:
            return
        trainer.log(
            f"warning: loss spike at step {spike.step}: loss {spike.loss:.4f}, expected "
            f"{spike.expected:.4f} (robust z-score {spike.score:.1f})"
        )
        out.scalars.update(
            {
                "spikes/loss": spike.loss,
                "spikes/expected_loss": spike.expected,
                "spikes/score": spike.score,
            }
        )
        out.events.append(
            (
                "spikes",
                f"step {spike.step}: loss {spike.loss:.4f}, expected "
                f"{spike.expected:.4f}, score {spike.score:.1f}",
            )
        )

    def state_dict(self) -> dict[str, Any]:
        return self.detector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state)
