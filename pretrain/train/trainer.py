"""The training loop: `Trainer(cfg).fit()`.

    fit()                      set up, resume, then train_step() until train_iters
      setup()                  process group, data, DeepSpeed engine, resume from a checkpoint
      train_step()             one optimizer step: forward_backward() per micro batch, one
                               all-reduce, the engine's step (which the StepGuard may skip);
                               returns a StepOutput
      rollback()               back to the checkpoint before a run of loss spikes, skipping
                               their data (spikes.rollback_after; pretrain/train/spikes.py)
      callbacks                everything else, on a few hooks (pretrain/train/callbacks/):
                               console, metrics, TensorBoard, W&B, speed and MFU, spikes,
                               attention logits, evaluation, checkpoints, pre-emption

The step is the only numerics here; a callback reads the trainer and the StepOutput, adds
scalars to it, and may save (`trainer.save()`) or ask to stop (`trainer.stop_signal`).
A signal-triggered stop saves after the current step and exits with EXIT_PREEMPTED (99),
which the Slurm scripts requeue on.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import yaml

from pretrain.config import Config, ConfigError, FaultConfig, ModelConfig, to_dict
from pretrain.config_checks import check_run, grad_accum_steps
from pretrain.data.pipeline import DataSource, build_data
from pretrain.model.transformer import Transformer
from pretrain.model.weights import save_weights
from pretrain.run_layout import (
    ROLLBACKS_FILE,
    CheckpointSaveError,
    RunLayout,
    atomic_write,
    step_tag,
    tag_step,
)
from pretrain.train import distributed as dist_utils
from pretrain.train.callbacks import Callback, StepOutput, build_callbacks
from pretrain.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    complete_tags,
    find_resume_tag,
    read_state,
)
from pretrain.train.engine import build_engine
from pretrain.train.spikes import (
    DataWindows,
    Rollback,
    StepGuard,
    read_rollbacks,
    write_rollbacks,
)

EXIT_OK = 0
EXIT_PREEMPTED = 99  # a signal-triggered checkpoint was written; requeue and re-run


class Trainer:
    """Trains (or resumes) the run that `cfg` describes.

    `data` replaces the megatron-core pipeline (in-memory datasets for tests and the
    throughput benchmark); `callbacks` replaces the ones the config chooses
    (`build_callbacks(cfg)`); `save_checkpoints=False` writes none (the benchmark).
    """

    def __init__(
        self,
        cfg: Config,
        data: DataSource | None = None,
        callbacks: list[Callback] | None = None,
        save_checkpoints: bool = True,
    ) -> None:
        self.cfg = cfg
        self.data = data
        self.callbacks = (
            callbacks if callbacks is not None else build_callbacks(cfg, save_checkpoints)
        )
        self.layout = RunLayout(cfg.logging.run_dir, cfg.checkpoint.dir)
        self.resolved: dict[str, Any] = to_dict(cfg)
        self.step = 0  # optimizer steps done (skipped ones included)
        # Samples of the data stream passed, over all ranks: trained on, or skipped with a
        # skipped step or a skipped data window (as Megatron counts consumed samples).
        self.consumed = 0
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
            if self.step >= self.cfg.train.train_iters:
                self.log(
                    f"run already finished: step {self.step} >= "
                    f"train.train_iters={self.cfg.train.train_iters}"
                )
                exit_code = EXIT_OK
                return exit_code
            self.fire("on_train_start")
            self.train_started = True
            while self.step < self.cfg.train.train_iters:
                out = self.train_step()
                self.fire("on_step_end", out)
                if out.stopping:
                    exit_code = EXIT_PREEMPTED
                    break
                first = self.guard.rollback_due(self.step)
                if first is not None:
                    self.rollback(*first)
            else:
                exit_code = EXIT_OK
        finally:
            self.fire("on_fit_end", exit_code)
        dist_utils.barrier()
        return exit_code

    def train_step(self) -> StepOutput:
        """One optimizer step over `grad_accum` micro batches of this rank."""
        lr = self.engine.get_lr()[0]  # the scheduler's rate for this update
        self._position_data()
        data_step = self.consumed // self.cfg.train.global_batch_size + 1
        fault = self.faults.get(data_step)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        z_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        token_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        first = None
        for i in range(self.grad_accum):
            batch = self._next_batch()
            x, y = batch["input_ids"].to(self.device), batch["labels"].to(self.device)
            if fault is not None and fault.kind == "noise":
                x, y = self._noise_batch(x, data_step, i)
            first = x[:1] if first is None else first
            loss, z_term = self.forward_backward(x, y, fault)
            loss_sum += loss
            z_sum += z_term
            token_sum += x.sum(dtype=torch.float64)
            if i < self.grad_accum - 1:
                self.engine.step()  # DeepSpeed counts micro steps; no update off the boundary
        self.step += 1
        self.consumed += self.cfg.train.global_batch_size
        # One collective per step, before the update (the guard judges the step on it): the
        # global mean loss, "did any rank get a signal", the sum of the step's token ids (a
        # fingerprint that shows a resume read the same data) and the z-loss term.
        flag = torch.tensor(
            float(self.stop_signal is not None), dtype=torch.float64, device=self.device
        )
        stats = dist_utils.all_reduce_sum(
            torch.stack([loss_sum / self.grad_accum, flag, token_sum, z_sum / self.grad_accum])
        )
        loss, stopping = float(stats[0]) / self.env.world_size, float(stats[1]) > 0
        self.guard.begin(self.step, data_step, loss)
        self.engine.step()  # the update, unless the guard withholds it
        verdict = self.guard.finish()
        grad_norm = verdict.grad_norm
        scalars = {"train/loss": loss, "train/lr": lr}
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        if self.cfg.train.z_loss:
            scalars["train/z_loss"] = float(stats[3]) / self.env.world_size
        return StepOutput(
            step=self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=self.tokens_per_step,
            batch_token_sum=float(stats[2]),
            stopping=stopping,
            first_input=first,
            log=self._is_log_step(stopping),
            scalars=scalars,
            verdict=verdict,
        )

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, fault: FaultConfig | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of one micro batch and its backward (DeepSpeed reduces the gradients at the
        accumulation boundary). Returns the detached cross-entropy and z-loss term in fp64.
        `fault` corrupts the micro batch on purpose (spikes.faults)."""
        z = self.cfg.train.z_loss
        loss = self.engine(x, targets=y, z_loss=z) if z else self.engine(x, targets=y)
        z_term = (
            self.module.last_z_loss.detach().double()
            if z
            else loss.new_zeros((), dtype=torch.float64)
        )
        objective = loss
        if fault is not None and fault.kind != "noise":
            if fault.kind == "nan":
                objective = loss = loss * float("nan")
            elif fault.kind == "scale_loss":
                objective = loss = loss * fault.factor
            else:  # scale_grads: the gradients only
                objective = loss * fault.factor
        self.engine.backward(objective)
        return loss.detach().double() - z_term, z_term

    def _noise_batch(self, x: torch.Tensor, data_step: int, micro: int):
        """Uniformly random token ids in place of a micro batch (spikes.faults kind noise),
        the same for a data step on every run of the config."""
        g = torch.Generator().manual_seed(
            hash((self.cfg.train.seed, data_step, micro, self.env.rank)) % 2**63
        )
        seq = torch.randint(0, self.cfg.model.vocab_size, (x.shape[0], x.shape[1] + 1), generator=g)
        return seq[:, :-1].to(self.device), seq[:, 1:].to(self.device)

    def rollback(self, first_step: int, first_data_step: int) -> None:
        """Back to the newest checkpoint before `first_step` (the first flagged step of a run
        of spikes), never to train on the data from `first_data_step` - rollback_skip_before
        to this step's + rollback_skip_after. Every rank calls it, with the same arguments."""
        c, at = self.cfg.spikes, self.step
        self.guard.flagged_steps.clear()
        if len(self.rollbacks) >= c.max_rollbacks:
            self.log(
                f"warning: not rolling back at step {at}: spikes.max_rollbacks={c.max_rollbacks} "
                f"reached; flagged steps are still skipped when spikes.skip_step is on"
            )
            return
        try:
            tag = find_resume_tag(
                self.layout.checkpoints,
                self.cfg.checkpoint.verify,
                self.env.rank,
                self.env.world_size,
                before=first_step,
            )
        except CheckpointError:  # all damaged (each named in a warning above)
            tag = None
        if tag is None:
            self.log(
                f"warning: cannot roll back at step {at}: no intact checkpoint before the first "
                f"spike (step {first_step}); save more often (checkpoint.interval) or keep more "
                f"(checkpoint.keep_last)"
            )
            return
        to_step = tag_step(tag)
        gbs = self.cfg.train.global_batch_size
        resume_data_step = read_state(self.layout.checkpoints / tag)["consumed_samples"] // gbs + 1
        current_data_step = self.consumed // gbs
        skip = (
            max(resume_data_step, first_data_step - c.rollback_skip_before),
            current_data_step + c.rollback_skip_after,
        )
        record = Rollback(len(self.rollbacks) + 1, at, to_step, first_step, skip)
        if self.is_main:
            write_rollbacks(self.layout.root, [*self.rollbacks, record])
        dist_utils.barrier()
        self.rollbacks.append(record)
        self.log(
            f"warning: rollback {record.index}: {c.rollback_after} of the last "
            f"{c.rollback_within} steps were spikes (the first at step {first_step}); back to "
            f"checkpoint {tag} (step {to_step}), never training on data steps "
            f"{skip[0]}-{skip[1]}"
        )
        _test_kill("record")
        self._drop_stale_checkpoints()
        self._load(tag)
        self.fire("on_rollback", record)
        _test_kill("done")

    # ------------------------------------------------------------------------- set-up

    def setup(self) -> None:
        """Process group, data, engine, and the newest complete checkpoint when one exists."""
        cfg, t = self.cfg, self.cfg.train
        self.env = dist_utils.setup_env()
        self.device = dist_utils.device_for(self.env)
        check_run(cfg, self.env.world_size, check_data=self.data is None)
        self.grad_accum = grad_accum_steps(cfg, self.env.world_size)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.env.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        dist_utils.init_process_group(self.device)
        if self.is_main:
            self.layout.root.mkdir(parents=True, exist_ok=True)
            self._warn_config_changes()

        self.eval_enabled = (
            bool(cfg.data.valid or self.data is not None)
            and t.eval_interval > 0
            and t.eval_iters > 0
        )
        if self.data is None:
            valid_samples = t.eval_iters * t.global_batch_size if self.eval_enabled else 0
            self.data = build_data(cfg, self.env, valid_samples)
        self.eval_enabled = self.eval_enabled and self.data.valid is not None

        self.engine = build_engine(cfg, self.env.world_size, self.device)
        self.module: Transformer = self.engine.module
        self.guard = StepGuard(cfg.spikes, self.env.world_size)
        self.guard.install(self.engine)
        self.faults = {
            s: f for f in cfg.spikes.faults for s in range(f.step, (f.last or f.step) + 1)
        }
        self.rollbacks = read_rollbacks(self.layout.root) if cfg.checkpoint.resume else []
        if not cfg.checkpoint.resume and self.is_main:  # a run started over forgets them
            (self.layout.root / ROLLBACKS_FILE).unlink(missing_ok=True)
        self.checkpointer = Checkpointer(
            self.layout.checkpoints, cfg.checkpoint.keep_last, self.env.rank, self.env.world_size
        )
        if cfg.checkpoint.resume:
            self._resume()
        if self.is_main:
            atomic_write(
                self.layout.config, yaml.safe_dump(self.resolved, sort_keys=False), fsync=False
            )
        self.tokens_per_step = t.global_batch_size * cfg.seq_len

    def _position_data(self) -> None:
        """(Re)open the data stream where the next step reads: past any skipped window."""
        gbs = self.cfg.train.global_batch_size
        windows = DataWindows([*self.cfg.spikes.skip_data, *(r.skip for r in self.rollbacks)])
        data_step = windows.next_data_step(self.consumed // gbs + 1)
        if self._batches is not None and data_step == self.consumed // gbs + 1:
            return
        if data_step != self.consumed // gbs + 1:
            self.log(
                f"skipping data steps {self.consumed // gbs + 1}-{data_step - 1} "
                f"(spikes.skip_data, {self.layout.root / ROLLBACKS_FILE})"
            )
        self.consumed = (data_step - 1) * gbs
        self._batches = self.data.train_batches(self.cfg, self.env, self.consumed)

    def _drop_stale_checkpoints(self) -> None:
        """Delete the checkpoints a rollback went back past: written after its first spike
        and before it (their `rollbacks` count is lower than its index). Idempotent, so a
        resume after a kill in the middle of a rollback finishes it."""
        if self.is_main:
            for tag in complete_tags(self.layout.checkpoints):
                folder = self.layout.checkpoints / tag
                done = read_state(folder).get("rollbacks", 0)
                if any(tag_step(tag) > r.to_step and done < r.index for r in self.rollbacks):
                    self.log(f"removing checkpoint {tag}: it is past a rollback")
                    self.checkpointer.discard(tag)
        dist_utils.barrier()

    def _load(self, tag: str) -> None:
        """Restore checkpoint `tag`: engine, step, data position and callback state."""
        state = self.checkpointer.load(self.engine, tag)
        self.step, self.consumed = state["step"], state["consumed_samples"]
        if self.consumed % self.cfg.train.global_batch_size:
            raise ConfigError(
                f"checkpoint {tag} consumed {self.consumed} samples, not a multiple of "
                f"train.global_batch_size={self.cfg.train.global_batch_size}; resume with the "
                f"batch size it was trained with"
            )
        saved_callbacks = state.get("callbacks", {})
        if "spike_detector" in state:  # checkpoints written before callbacks had state
            saved_callbacks.setdefault("spikes", state["spike_detector"])
        self.guard.load_state_dict(state.get("spike_guard", saved_callbacks.get("spikes", {})))
        for cb in self.callbacks:
            if cb.state_key and cb.state_key in saved_callbacks:
                cb.load_state_dict(saved_callbacks[cb.state_key])
        self._batches = None  # reopened where the next step reads

    def _resume(self) -> None:
        if self.rollbacks:
            self._drop_stale_checkpoints()
        tag = find_resume_tag(
            self.layout.checkpoints, self.cfg.checkpoint.verify, self.env.rank, self.env.world_size
        )
        if tag is None:
            return
        folder = self.layout.checkpoints / tag
        saved = read_state(folder).get("config", {}).get("model", {})
        # A field added since the checkpoint was written counts as its default.
        saved = {**to_dict(ModelConfig()), **saved}
        changed = _diff(saved, self.resolved["model"], "model")
        if changed:
            raise ConfigError(
                f"{folder} holds a different model ({'; '.join(changed)}); use a new "
                f"logging.run_dir, or --set checkpoint.resume=false to start this run over"
            )
        self._load(tag)
        self.resumed_from = tag
        self.log(f"resumed from {folder} (step {self.step}, {self.consumed:,} samples)")

    # ------------------------------------------------------------------------- services

    def save(self) -> Path:
        """Checkpoint the current step (every rank calls it); returns its folder."""
        state = {
            "consumed_samples": self.consumed,
            "consumed_tokens": self.consumed * self.cfg.seq_len,
            "data": {"consumed_samples": self.consumed, "train": list(self.cfg.data.train)},
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks if cb.state_key},
            "spike_guard": self.guard.state_dict(),
            "rollbacks": len(self.rollbacks),  # rollbacks before it (see _drop_stale_checkpoints)
            "config": self.resolved,
        }
        try:
            folder = self.checkpointer.save(self.engine, self.step, state, self._write_weights)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
            previous = find_resume_tag(self.layout.checkpoints, "none")
            raise CheckpointSaveError(
                f"saving checkpoint {step_tag(self.step)} failed ({type(e).__name__}: {e}); "
                + (f"the previous checkpoint {previous} is intact: " if previous else "")
                + "free space (or fix the file system) and run the same command to resume"
            ) from None
        self.log(f"saved checkpoint {folder}")
        self.fire("on_save", folder)
        return folder

    def valid_batches(self) -> list:
        return self.data.valid_batches(
            self.cfg, self.env, self.cfg.train.eval_iters * self.grad_accum
        )

    def fire(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    @property
    def is_main(self) -> bool:
        return getattr(self, "env", None) is None or self.env.is_main

    def log(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)

    def _write_weights(self, folder: Path) -> None:
        save_weights(self.module, folder, self.resolved, dtype=None)
        if self.data.tokenizer is not None:
            self.data.tokenizer.save(folder / "tokenizer")

    def _next_batch(self) -> dict[str, torch.Tensor]:
        try:
            return next(self._batches)
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at step {self.step + 1}; the dataset holds fewer "
                f"than train_iters x global batch samples"
            ) from None

    def _is_log_step(self, stopping: bool) -> bool:
        t = self.cfg.train
        return (
            self.step % self.cfg.logging.log_interval == 0 or self.step == t.train_iters or stopping
        )

    def _warn_config_changes(self) -> None:
        """On a re-run, say which settings differ from the run config saved by the last one."""
        path = self.layout.config
        if path.is_file():
            changed = _diff(yaml.safe_load(path.read_text()) or {}, self.resolved)
            if changed:
                self.log("warning: config differs from the saved run config: " + ", ".join(changed))


def _test_kill(point: str) -> None:
    """Tests kill the process at a point of a rollback (PRETRAIN_TEST_KILL_IN_ROLLBACK)."""
    if os.environ.get("PRETRAIN_TEST_KILL_IN_ROLLBACK") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [f"{prefix} {a!r} -> {b!r}"]


def train(cfg: Config, data: DataSource | None = None, save_checkpoints: bool = True) -> int:
    """Train (or resume) the run described by `cfg`. Returns EXIT_OK or EXIT_PREEMPTED."""
    return Trainer(cfg, data, save_checkpoints=save_checkpoints).fit()


__all__ = ["EXIT_OK", "EXIT_PREEMPTED", "Trainer", "train"]
