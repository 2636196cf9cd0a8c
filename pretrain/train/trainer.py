"""The training loop: `Trainer(cfg).fit()`.

    fit()                  set up (one frozen RunContext, self.run), resume, then step to
                           train_iters; per step:
      train_step()         the TrainModule's forward/backward per micro batch and guarded
                           update (pretrain/train/module.py), one all-reduce; the step's
                           named values recorded on the device; its StepRecord
      evaluators           the due ones (pretrain/train/evaluators/), in the slow phase
      on_step_end          callbacks add host scalars to the record
      flush()              at logging steps and before a save, stop or rollback: the steps
                           read in one transfer, judged by the spike guard, published in
                           step order to the sinks (console, metrics file, TensorBoard,
                           W&B: pretrain/train/publish.py, sinks.py), then on_values
      checkpoint schedule  save when due (pretrain/train/checkpoint_schedule.py)
      rollback()           back past a run of loss spikes (pretrain/train/recovery.py)

Callbacks (pretrain/train/callbacks/) read a few names of the trainer (callbacks/base.py)
and may save or ask to stop (`stop_signal`: a checkpoint, then EXIT_PREEMPTED).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import yaml

from pretrain.config import Config, ConfigError, to_dict
from pretrain.data.pipeline import DataSource
from pretrain.exit_codes import EXIT_OK, EXIT_PREEMPTED
from pretrain.faults import fault_point
from pretrain.model.pairs import resolve_pairs
from pretrain.run_layout import ROLLBACKS_FILE, RunLayout, atomic_write
from pretrain.train import distributed as dist_utils
from pretrain.train.callbacks import Callback, build_callbacks, build_evaluators
from pretrain.train.checkpoint import find_resume_tag, save_failed
from pretrain.train.checkpoint_schedule import CheckpointSchedule
from pretrain.train.context import RunContext, build_context
from pretrain.train.engine import RunPlanner
from pretrain.train.evaluators import Evaluator, run_due
from pretrain.train.metrics import LOSS, Reduce, StepRecord
from pretrain.train.publish import Publisher, Sink
from pretrain.train.records import Record, Rewound
from pretrain.train.recovery import (
    check_same_model,
    drop_stale_checkpoints,
    next_data_step,
    plan_rollback,
    record_rollback,
    saved_states,
    trainer_state,
)
from pretrain.train.sinks import build_sinks
from pretrain.train.spikes import Rollback, read_rollbacks
from pretrain.train.watchdog import slow_phase
from pretrain.weights import init_from_summary, save_weights


class Trainer:
    """Trains (or resumes) the run that `cfg` describes. Instead of what the config chooses:
    `data` (in-memory datasets for tests and the benchmark), `callbacks` (build_callbacks;
    the evaluators stay the config's), `sinks` (build_sinks); `save_checkpoints=False`
    writes none. `planner` decides the "auto" of `activation_checkpointing` and `compile`
    (the program passes the planner's; training itself never imports the planner).
    """

    def __init__(
        self,
        cfg: Config,
        data: DataSource | None = None,
        callbacks: list[Callback] | None = None,
        save_checkpoints: bool = True,
        planner: RunPlanner | None = None,
        sinks: list[Sink] | None = None,
    ) -> None:
        # A usage pair selection is read from its map once, here: the run's config records it.
        if (model := resolve_pairs(cfg.model)) is not cfg.model:
            cfg = cfg.replace(model=model)
        self.cfg = cfg
        self.given_data = data
        self.planner = planner
        self.callbacks = callbacks if callbacks is not None else build_callbacks(cfg)
        self.publisher = Publisher(sinks if sinks is not None else build_sinks(cfg))
        self.checkpoints = CheckpointSchedule(cfg.checkpoint.interval) if save_checkpoints else None
        self.evaluators: list[Evaluator] = []  # built by setup(), once the data is known
        self.layout = RunLayout(cfg.logging.run_dir, cfg.checkpoint.dir)
        self.resolved: dict[str, Any] = to_dict(cfg)
        self.run: RunContext | None = None  # built by setup()
        self.step = 0  # optimizer steps done (skipped ones included)
        # Samples of the data stream passed, over all ranks: trained on, or skipped with a
        # skipped step or a skipped data window (as Megatron counts consumed samples).
        self.consumed = 0
        self.rollbacks: list[Rollback] = []
        self.resumed_from: str | None = None
        self.stop_signal: int | None = None  # set by a signal handler; stops after this step
        self.train_started = False  # on_train_start has fired
        self._batches = None  # this rank's micro batches, opened at the data position

    # ------------------------------------------------------------------------- the loop

    def fit(self) -> int:
        """Train to train.train_iters. Returns EXIT_OK, or EXIT_PREEMPTED after a signal."""
        self.fire("on_fit_start")  # first: a signal during set-up stops after the first step
        exit_code: int | None = None  # None: an error ends the run
        try:
            self.setup()
            if self.step >= (iters := self.cfg.train.train_iters):
                self.log(f"run already finished: step {self.step} >= train.train_iters={iters}")
                exit_code = EXIT_OK
                return exit_code
            for evaluator in self.evaluators:
                evaluator.setup(self)
            if self.checkpoints is not None:
                self.checkpoints.start(self)
            self.fire("on_train_start")
            self.publisher.open(self)
            self.train_started = True
            while self.step < iters:
                record = self.train_step()
                last = self.step == iters
                self._evaluate(record, last)
                self.fire("on_step_end", record)
                saving = self.checkpoints is not None and self.checkpoints.due(
                    self.step, last, record.stopping
                )
                if record.log or record.evaluation or saving or record.stopping:
                    self.flush()
                if saving:
                    self.checkpoints.save(self, last, record.stopping)
                if record.stopping:
                    exit_code = EXIT_PREEMPTED
                    break
                episode = self.run.module.rollback_due()  # judged at a flush or a save
                if episode is not None:
                    self.flush()
                    self.rollback(*episode)
            else:
                exit_code = EXIT_OK
        finally:
            self._batches = None  # stop its workers now: collected in a cycle, each waited 5 s
            self._end(exit_code)
        dist_utils.barrier()
        return exit_code

    def train_step(self) -> StepRecord:
        """One optimizer step over `grad_accum` micro batches of this rank."""
        run, module = self.run, self.run.module
        lr = module.lr
        self._position_data()
        data_step = self.consumed // self.cfg.train.global_batch_size + 1
        module.metrics.open(self.step + 1)
        first = None
        for i in range(run.grad_accum):
            batch = self._next_batch()
            x, y = batch["input_ids"].to(run.device), batch["labels"].to(run.device)
            first = x[:1] if first is None else first
            module.forward_backward(x, y, data_step, i, batch)
            # The step's token-id sum: a fingerprint that shows a resume read the same data.
            module.metrics.record("progress/batch_token_sum", x.sum(dtype=torch.float64), "sum")
            if i < run.grad_accum - 1:
                module.micro_step()
        self.step += 1
        self.consumed += self.cfg.train.global_batch_size
        # The one collective every step needs, before the update: "did any rank get a
        # signal", and the global mean loss that spikes.skip_step judges inside the update.
        # Every other value waits for the flush (StepMetrics.read).
        stop = torch.tensor(float(self.stop_signal is not None), device=run.device)
        with module.timer.part("collective"):
            sums = dist_utils.all_reduce_named(
                {"stop": stop.double(), "loss": module.metrics.current(LOSS)}
            )
        stopping = module.stop_requested(sums["stop"])
        record = StepRecord(
            self.step, lr, run.tokens_per_step, stopping, first, self._is_log_step(stopping)
        )
        module.optimizer_step(record, data_step, sums["loss"] / run.env.world_size)
        return record

    def _evaluate(self, record: StepRecord, last: bool) -> None:
        results = run_due(self.evaluators, self, record, last)
        if results is not None:
            self.fire("on_evaluation", results)

    def flush(self) -> None:
        """Publish every step taken and not yet published, in step order: to the sinks, then
        on_values."""
        self.run.module.settle()
        outs = self.run.module.metrics.flush()
        if outs:
            self.publisher.publish(outs)
            self.fire("on_values", outs)

    def record_metric(
        self, name: str, value: torch.Tensor | float, reduce: Reduce = "mean"
    ) -> None:
        """Record a value of the step being taken under `name` on every rank (a 0-d device
        tensor is not read): combined by `reduce` (mean, sum, max, min) over the calls in
        the step (once per micro batch) and over the ranks, then written by every sink with
        the step (StepMetrics.record). Host figures a callback computes after the step
        (on_step_end) go into the StepRecord's `scalars` instead."""
        self.run.module.metrics.record(name, value, reduce)

    def publish(self, record: Record) -> None:
        """A record of its own to every sink (a hang's verdict)."""
        self.publisher.publish([record])

    def _end(self, exit_code: int | None) -> None:
        """The run's end, on every path: what is left published (a run that failed on the
        device may fail to read: what was read is written), saves in flight landed, then
        on_fit_end."""
        if self.run is not None:
            if exit_code is None:
                with contextlib.suppress(Exception):
                    self.flush()
                self.run.module.metrics.drop()
            else:
                self.flush()
        if self.checkpoints is not None:
            self.checkpoints.end(self, exit_code)
        if self.train_started:
            self.publisher.close(self, exit_code)
        self.fire("on_fit_end", exit_code)

    def rollback(self, first_step: int, first_data_step: int, last_data_step: int) -> None:
        """Back to the newest checkpoint before `first_step` (a run of spikes' first), never
        to train on data steps up to `last_data_step` (the episode's last) + skip_after
        (recovery.plan_rollback). Every rank calls it, with the same arguments."""
        self.wait_for_saves()  # a save in flight (checkpoint.async) lands first
        self.run.module.forget_flags()
        at, first = (self.step, last_data_step), (first_step, first_data_step)
        planned = plan_rollback(
            self.cfg, self.layout, self.run.env, self.rollbacks, at, first, self.log
        )
        if planned is None:
            return
        record, tag = planned
        record_rollback(self.layout, self.rollbacks, record, self.is_main)
        fault_point("rollback_recorded", self.step)
        self._drop_stale_checkpoints()
        self._load(tag)
        self.publisher.publish([Rewound.of(record, self.step)])
        self.fire("on_rollback", record)
        fault_point("rollback_done", self.step)

    # ------------------------------------------------------------------------- set-up

    def setup(self) -> None:
        """Process group, data, engine: the RunContext; then resume from a checkpoint."""
        cfg = self.cfg
        self.run = build_context(cfg, self.layout, self.given_data, self.planner, self.log)
        self.evaluators = build_evaluators(cfg, self.run.eval_enabled)
        self.rollbacks = read_rollbacks(self.layout.root) if cfg.checkpoint.resume else []
        if not cfg.checkpoint.resume and self.is_main:  # a run started over forgets them
            (self.layout.root / ROLLBACKS_FILE).unlink(missing_ok=True)
        if cfg.checkpoint.resume:
            self._resume()
        if self.resumed_from is None and cfg.checkpoint.init_from:
            self.log(init_from_summary(cfg.checkpoint.init_from, cfg.model))
        if self.is_main:
            atomic_write(
                self.layout.config, yaml.safe_dump(self.resolved, sort_keys=False), fsync=False
            )

    def _position_data(self) -> None:
        """(Re)open the data stream where the next step reads: past any skipped window."""
        gbs = self.cfg.train.global_batch_size
        data_step = next_data_step(self.cfg, self.consumed, self.rollbacks, self.layout, self.log)
        if self._batches is None or data_step != self.consumed // gbs + 1:
            self.consumed = (data_step - 1) * gbs
            self._batches = self.run.data.train_batches(self.cfg, self.run.env, self.consumed)

    def _drop_stale_checkpoints(self) -> None:
        drop_stale_checkpoints(
            self.layout, self.run.checkpointer, self.rollbacks, self.is_main, self.log
        )

    def _load(self, tag: str) -> None:
        """Restore checkpoint `tag`: engine, step, data position and callback state."""
        with slow_phase("a checkpoint"):
            state = self.run.checkpointer.load(self.run.module.engine, tag, self.cfg.train.seed)
        self.step, self.consumed = state["step"], state["consumed_samples"]
        if self.consumed % self.cfg.train.global_batch_size:
            raise ConfigError(
                f"checkpoint {tag} consumed {self.consumed} samples, not a multiple of "
                f"train.global_batch_size={self.cfg.train.global_batch_size}; resume with the "
                f"batch size it was trained with"
            )
        guard, saved_callbacks = saved_states(state)
        self.run.module.settle()  # steps taken before the load meet the guard they knew
        self.run.module.load_state_dict(guard)
        for cb in self._stateful():
            if cb.state_key and cb.state_key in saved_callbacks:
                cb.load_state_dict(saved_callbacks[cb.state_key])
        self._batches = None  # reopened where the next step reads

    def _resume(self) -> None:
        if self.rollbacks:
            self._drop_stale_checkpoints()
        env = self.run.env
        tag = find_resume_tag(
            self.layout.checkpoints, self.cfg.checkpoint.verify, env.rank, env.world_size
        )
        if tag is None:
            return
        folder = self.layout.checkpoints / tag
        check_same_model(folder, self.resolved)
        self._load(tag)
        self.resumed_from = tag
        self.log(f"resumed from {folder} (step {self.step}, {self.consumed:,} samples)")

    # ------------------------------------------------------------------------- services

    def save(self) -> Path:
        """Checkpoint the current step (every rank calls it); returns its folder."""
        module, stateful = self.run.module, self._stateful()
        module.settle()  # the guard's history holds every step taken
        rollbacks, resolved = self.rollbacks, self.resolved
        state = trainer_state(self.cfg, self.consumed, stateful, module, rollbacks, resolved)
        try:
            with slow_phase("a checkpoint"):
                folder = self.run.checkpointer.save(
                    self.run.module.engine, self.step, state, self._write_weights
                )
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
            raise save_failed(e, self.layout.checkpoints, self.step) from None
        self.publisher.flush()
        self.fire("on_save", folder)
        return folder

    def _stateful(self) -> list[Callback | Sink]:
        """What has its state in a checkpoint, by state_key: callbacks and sinks."""
        return [*self.callbacks, *self.publisher.sinks]

    def wait_for_saves(self) -> None:
        """Until a save in flight (checkpoint.async) is on disk; its error, if it failed."""
        with slow_phase("a checkpoint"):
            self.run.checkpointer.wait()

    def fire(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    @property
    def is_main(self) -> bool:
        return self.run is None or self.run.env.is_main

    def log(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)

    def _write_weights(self, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        save_weights(self.run.module.model, folder, self.resolved, dtype=None, state=weights)
        if self.run.data.tokenizer is not None:
            self.run.data.tokenizer.save(folder / "tokenizer")

    def _next_batch(self) -> dict[str, torch.Tensor]:
        try:
            with self.run.module.timer.part("data", host=True):  # this rank's own time
                return next(self._batches)
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at step {self.step + 1}; the dataset holds fewer "
                f"than train_iters x global batch samples"
            ) from None

    def _is_log_step(self, stopping: bool) -> bool:
        last = self.step == self.cfg.train.train_iters
        return self.step % self.cfg.logging.log_interval == 0 or last or stopping


def train(cfg: Config, data: DataSource | None = None, **kwargs: Any) -> int:
    """Train (or resume) the run `cfg` describes (Trainer's arguments): EXIT_OK, EXIT_PREEMPTED."""
    return Trainer(cfg, data, **kwargs).fit()
