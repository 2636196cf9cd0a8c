"""The training loop: `Trainer(cfg).fit()`.

    fit()                      set up, resume, then train_step() until train_iters
      setup()                  process group, data, DeepSpeed engine, resume from a checkpoint
      train_step()             one optimizer step: forward_backward() per micro batch, the
                               engine's step, one all-reduce; returns a StepOutput
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
from pathlib import Path
from typing import Any

import torch
import yaml

from pretrain.config import Config, ConfigError, to_dict
from pretrain.config_checks import check_config
from pretrain.data.pipeline import DataSource, build_data
from pretrain.model.transformer import Transformer
from pretrain.model.weights import save_weights
from pretrain.run_layout import CheckpointSaveError, RunLayout, atomic_write, step_tag
from pretrain.train import distributed as dist_utils
from pretrain.train.callbacks import Callback, StepOutput, build_callbacks
from pretrain.train.checkpoint import (
    Checkpointer,
    find_resume_tag,
    read_state,
)
from pretrain.train.engine import build_engine

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
        self.step = 0  # optimizer steps done
        self.consumed = 0  # samples consumed, over all ranks
        self.resumed_from: str | None = None
        self.stop_signal: int | None = None  # set by a signal handler; stops after this step
        self.train_started = False  # on_train_start has fired

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
            else:
                exit_code = EXIT_OK
        finally:
            self.fire("on_fit_end", exit_code)
        dist_utils.barrier()
        return exit_code

    def train_step(self) -> StepOutput:
        """One optimizer step over `grad_accum` micro batches of this rank."""
        lr = self.engine.get_lr()[0]  # the scheduler's rate for this update
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        token_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        first = None
        for _ in range(self.grad_accum):
            batch = self._next_batch()
            x, y = batch["input_ids"].to(self.device), batch["labels"].to(self.device)
            first = x[:1] if first is None else first
            loss_sum += self.forward_backward(x, y)
            token_sum += x.sum(dtype=torch.float64)
        self.step += 1
        self.consumed += self.cfg.train.global_batch_size
        # One collective per step: the global mean loss, "did any rank get a signal", and the
        # sum of the step's token ids (a fingerprint that shows a resume read the same data).
        flag = torch.tensor(
            float(self.stop_signal is not None), dtype=torch.float64, device=self.device
        )
        stats = dist_utils.all_reduce_sum(
            torch.stack([loss_sum / self.grad_accum, flag, token_sum])
        )
        loss, stopping = float(stats[0]) / self.env.world_size, float(stats[1]) > 0
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        scalars = {"train/loss": loss, "train/lr": lr}
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
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
        )

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Loss of one micro batch, its backward, and the engine's step (which applies the
        update at the accumulation boundary). Returns the detached loss in fp64."""
        loss = self.engine(x, targets=y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach().double()

    # ------------------------------------------------------------------------- set-up

    def setup(self) -> None:
        """Process group, data, engine, and the newest complete checkpoint when one exists."""
        cfg, t = self.cfg, self.cfg.train
        self.env = dist_utils.setup_env()
        self.device = dist_utils.device_for(self.env)
        self.grad_accum = check_config(cfg, self.env.world_size, check_data=self.data is None)
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
        self._batches = self.data.train_batches(cfg, self.env, self.consumed)

    def _resume(self) -> None:
        tag = find_resume_tag(
            self.layout.checkpoints, self.cfg.checkpoint.verify, self.env.rank, self.env.world_size
        )
        if tag is None:
            return
        folder = self.layout.checkpoints / tag
        saved = read_state(folder).get("config", {}).get("model", {})
        changed = _diff(saved, self.resolved["model"], "model")
        if changed:
            raise ConfigError(
                f"{folder} holds a different model ({'; '.join(changed)}); use a new "
                f"logging.run_dir, or --set checkpoint.resume=false to start this run over"
            )
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
        for cb in self.callbacks:
            if cb.state_key and cb.state_key in saved_callbacks:
                cb.load_state_dict(saved_callbacks[cb.state_key])
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
