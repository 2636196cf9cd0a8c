"""SIGTERM / SIGUSR1 (Slurm's warning before the time limit): save after the current step and
exit with 99 so that the job requeues itself (slurm/launch.sh)."""

from __future__ import annotations

import signal

from pretrain.train.callbacks.base import Callback, StepRecord


class Preemption(Callback):
    """The handler only records the signal; the trainer all-reduces "any rank signalled" with
    the step's loss, so every rank stops after the same step, and Checkpointing saves it."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}

    def on_fit_start(self, trainer) -> None:
        def handler(signum, frame) -> None:
            trainer.stop_signal = signum

        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, handler)

    def on_step_end(self, trainer, out: StepRecord) -> None:
        if out.stopping:
            sig = trainer.stop_signal
            name = signal.Signals(sig).name if sig else "a signal on another rank"
            trainer.log(
                f"received {name}: checkpoint written at step {out.step}; exiting with "
                f"99 so the job can be requeued"
            )

    def on_fit_end(self, trainer, exit_code) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
