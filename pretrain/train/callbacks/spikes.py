"""Loss spikes on the console: one warning line per flagged step, skipped update or
rollback decision the StepGuard (pretrain/train/spikes.py) made. The scalars (spikes/*) and
the text events are part of each step's values (pretrain/train/metrics.py spike_report),
written by the writers with the step."""

from __future__ import annotations

from pretrain.train.callbacks.base import Callback, StepOutput


class SpikeMonitor(Callback):
    """Every rank judges the same all-reduced values, so rank 0's lines speak for all."""

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        for out in outs:
            for tag, text in out.events:
                if tag == "spikes":
                    trainer.log("warning: " + text)
