"""The hang watchdog's hooks (pretrain/train/watchdog.py): armed when training starts, a
heartbeat after every step and save, stopped at the end; first of the callbacks, so that a
step's heartbeat comes before its save and the end reaches it before anything else."""

from __future__ import annotations

from pretrain.train.callbacks.base import Callback, StepRecord
from pretrain.train.records import Notice
from pretrain.train.watchdog import Watchdog, default_store


class HangWatchdog(Callback):
    """`timeout` seconds without a completed step (`long_timeout` at start and while saving,
    loading or evaluating) ends the job with EXIT_HUNG after every rank wrote its stacks."""

    def __init__(self, timeout: float, long_timeout: float | None = None) -> None:
        self.timeout = timeout
        self.long_timeout = long_timeout if long_timeout is not None else 4 * timeout
        self.watchdog: Watchdog | None = None

    def on_train_start(self, trainer) -> None:
        env, layout = trainer.run.env, trainer.layout
        self.watchdog = Watchdog(
            default_store(),
            env.rank,
            env.world_size,
            self.timeout,
            self.long_timeout,
            report=layout.hang_report,
            # The verdict, from whichever rank judged, to the sinks: the console of that
            # rank, and rank 0's TensorBoard (flushed: the process exits next).
            log=lambda line: trainer.publish(Notice(trainer.step, "hang", line)),
            step=trainer.step,
        )
        self.watchdog.start()
        trainer.log(
            f"hang watchdog: {self.timeout:g} s per step ({self.long_timeout:g} s at start and "
            f"while saving, loading or evaluating); on a hang, stacks go to {layout.hang}/"
        )

    def on_step_end(self, trainer, out: StepRecord) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(out.step)

    def on_save(self, trainer, folder) -> None:
        if self.watchdog is not None:
            self.watchdog.progress()

    def on_rollback(self, trainer, rollback) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(trainer.step)

    def on_fit_end(self, trainer, exit_code) -> None:
        if self.watchdog is not None:
            self.watchdog.close(failed=exit_code is None)  # after a verdict: EXIT_HUNG
            self.watchdog = None
