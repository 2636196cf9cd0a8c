"""The records a run publishes (pretrain/train/publish.py), host-side and frozen.

StepOutput   a finished step: its named scalars, the spike guard's verdict, its events
             (spike warnings) and images, each once
Rewound      a rollback: the step the run went back to, its scalars and its line
Notice       a line that belongs to no step's values (a hang's verdict)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pretrain.train.spikes import Rollback, Verdict


@dataclass(frozen=True)
class StepOutput:
    """A finished step. `scalars` holds every scalar the sinks write for it: train/loss,
    train/grad_norm, train/lr, progress/*, perf/*, valid/*, spikes/*, a callback's own."""

    step: int
    log: bool  # a logging step: the console prints its line
    scalars: Mapping[str, float]
    verdict: Verdict  # the loss-spike guard's (pretrain/train/spikes.py)
    events: tuple[tuple[str, str], ...]  # (tag, text)
    images: Mapping[str, Any]  # tag -> HWC uint8 RGB


@dataclass(frozen=True)
class Rewound:
    """A rollback, published once the run is back at `step` (its checkpoint's): the sinks
    drop what they hold past it and record the rollback there."""

    step: int
    scalars: Mapping[str, float]
    text: str

    @classmethod
    def of(cls, rollback: Rollback, step: int) -> Rewound:
        r = rollback
        return cls(
            step,
            {
                "spikes/rollbacks": float(r.index),
                "spikes/rollback_from": float(r.at_step),
                "spikes/skip_first": float(r.skip[0]),
                "spikes/skip_last": float(r.skip[1]),
            },
            f"rollback {r.index} at step {r.at_step} (first spike at step {r.first_spike}): "
            f"back to step {r.to_step}, data steps {r.skip[0]}-{r.skip[1]} skipped",
        )


@dataclass(frozen=True)
class Notice:
    """A line of its own at `step`, tagged (e.g. "hang")."""

    step: int
    tag: str
    text: str


Record = StepOutput | Rewound | Notice
