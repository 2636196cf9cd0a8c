"""Where the scalars go: the run's metrics file, TensorBoard, Weights & Biases. Rank 0 writes.

Every step is written once, in step order, when the trainer publishes it (`on_values`:
at logging steps and before a save, a stop, a rollback and the end; pretrain/train/
metrics.py). After a resume from step k, lines and TensorBoard events past k (written by the
run that died) are dropped, so curves never hold two histories; a rollback to step k drops
them the same way and records itself at step k (spikes/rollbacks, spikes/rollback_from).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import yaml

from pretrain.config import to_dict
from pretrain.run_layout import atomic_write, read_metrics
from pretrain.train.callbacks.base import Callback, StepOutput


def rollback_scalars(r) -> dict[str, float]:
    return {
        "spikes/rollbacks": float(r.index),
        "spikes/rollback_from": float(r.at_step),
        "spikes/skip_first": float(r.skip[0]),
        "spikes/skip_last": float(r.skip[1]),
    }


def rollback_text(r) -> str:
    return (
        f"rollback {r.index} at step {r.at_step} (first spike at step {r.first_spike}): back to "
        f"step {r.to_step}, data steps {r.skip[0]}-{r.skip[1]} skipped"
    )


def _clean(scalars: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items() if v is not None}


class MetricsFile(Callback):
    """The run's metrics file (pretrain.run_layout): one JSON object per step, {"step": 120, "train/loss": 3.1, ...}, so tools
    read runs without TensorBoard (pretrain.run_layout.read_metrics)."""

    def __init__(self) -> None:
        self.file = None

    def on_train_start(self, trainer) -> None:
        if trainer.is_main:
            self._open(trainer)

    def _open(self, trainer, extra: dict[str, Any] | None = None) -> None:
        path = trainer.layout.metrics
        if path.is_file():  # keep what the resumed checkpoint had seen
            rows = [r for r in read_metrics(trainer.layout.root) if r["step"] <= trainer.step]
            rows += [extra] if extra else []
            atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows), fsync=False)
        # Line-buffered: a kill loses at most the line being written.
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in on_fit_end)

    def on_rollback(self, trainer, rollback) -> None:
        if self.file is not None:
            self.file.close()
            self._open(trainer, {"step": trainer.step, **rollback_scalars(rollback)})

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        if self.file is not None:
            for out in outs:
                self.file.write(json.dumps({"step": out.step, **_clean(out.scalars)}) + "\n")

    def on_fit_end(self, trainer, exit_code) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class TensorBoard(Callback):
    """RUN/tensorboard/: every scalar, spike events as text, the resolved config at step 0."""

    def __init__(self) -> None:
        self.writer = None

    def on_train_start(self, trainer) -> None:
        if not trainer.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events past the checkpoint written by a run that died later.
        self.writer = SummaryWriter(
            str(trainer.layout.tensorboard), purge_step=trainer.step + 1 if trainer.step else None
        )
        if trainer.step == 0:
            self.writer.add_text(
                "config",
                "```\n" + yaml.safe_dump(to_dict(trainer.cfg), sort_keys=False) + "\n```",
                0,
            )

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        if self.writer is None:
            return
        for out in outs:
            for k, v in _clean(out.scalars).items():
                self.writer.add_scalar(k, v, out.step)
            for tag, text in out.events:
                self.writer.add_text(tag, text, out.step)
            for tag, image in out.images.items():
                self.writer.add_image(tag, image, out.step, dataformats="HWC")

    def on_rollback(self, trainer, rollback) -> None:
        if self.writer is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()  # reopened to purge the steps the rollback went back past
        self.writer = SummaryWriter(str(trainer.layout.tensorboard), purge_step=trainer.step + 1)
        for k, v in rollback_scalars(rollback).items():
            self.writer.add_scalar(k, v, trainer.step)
        self.writer.add_text("spikes", rollback_text(rollback), trainer.step)

    def on_save(self, trainer, folder) -> None:
        # On disk with the checkpoint: a run that dies later (a kill, a hang's exit) and
        # resumes from it has every event up to it (the ones after are purged anyway).
        if self.writer is not None:
            self.writer.flush()

    def on_fit_end(self, trainer, exit_code) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbLogger(Callback):
    """The same scalars in a Weights & Biases run (section `wandb:` of the config). A resumed
    run continues the same W&B run (its id is kept in the checkpoints)."""

    state_key = "wandb"

    def __init__(
        self,
        project: str = "pretrain",
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: str | None = None,
    ) -> None:
        self.options = dict(
            project=project, entity=entity, name=name, group=group, tags=list(tags or []), mode=mode
        )
        self.run_id: str | None = None
        self.run = None

    def on_train_start(self, trainer) -> None:
        if not trainer.is_main:
            return
        import wandb

        opts = dict(self.options)
        opts["name"] = opts["name"] or trainer.layout.root.name
        self.run_id = self.run_id or secrets.token_hex(6)  # a W&B run id: [a-z0-9]
        self.run = wandb.init(
            id=self.run_id,
            resume="allow",
            dir=str(trainer.layout.root),
            config=to_dict(trainer.cfg),
            **opts,
        )

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        if self.run is not None:
            for out in outs:
                self.run.log(_clean(out.scalars), step=out.step)

    def on_fit_end(self, trainer, exit_code) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if exit_code in (0, 99) else 1)
            self.run = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")
