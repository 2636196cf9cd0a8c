"""Loss by position during training (optional): how the model's use of context develops.

    callbacks:
      - {class: pretrain.train.callbacks.positions.PositionEvaluation, interval: 500}

Every `interval` steps (and at the last) it scores the validation batches the evaluation
uses (train.eval_iters global batches) once more, keeping each token's loss by its position
(pretrain/eval/positions.py), on every rank, all-reduced. Scalars valid_position/START-END for
a few ranges of positions (the first 16, up to 256, then by octave up to the training length)
go to the metrics file and TensorBoard, and on the main rank the whole curve goes to
TensorBoard as an image (tag valid_position/curve).
"""

from __future__ import annotations

import numpy as np

from pretrain.eval.metrics import evaluate_loss
from pretrain.eval.positions import PositionLosses
from pretrain.train.callbacks.base import Callback, StepOutput


def position_ranges(seq_len: int) -> list[tuple[int, int]]:
    """[0, 16), [16, 256), then octaves [256, 512), ... up to seq_len."""
    edges = [0, 16, 256]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 2)
    edges = sorted({min(e, seq_len) for e in edges})
    return list(zip(edges, edges[1:], strict=False))


def curve_image(stats: PositionLosses, step: int) -> np.ndarray:
    """The loss-by-position curve (log x) as an HWC uint8 RGB array for TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = stats.buckets()
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    ax.plot([(b.start + b.end + 1) / 2 for b in buckets], [b.loss for b in buckets])
    ax.set_xscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("valid loss")
    ax.set_title(f"loss by position, step {step}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image


class PositionEvaluation(Callback):
    def __init__(self, interval: int = 1000) -> None:
        if interval <= 0:
            raise ValueError(
                f"PositionEvaluation interval={interval} must be a positive step count"
            )
        self.interval = interval
        self.writer = None

    def on_train_start(self, trainer) -> None:
        if trainer.is_main and trainer.cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(trainer.layout.tensorboard))

    def on_step_end(self, trainer, out: StepOutput) -> None:
        last = out.step == trainer.cfg.train.train_iters
        run = trainer.run
        if not run.eval_enabled or not (out.step % self.interval == 0 or last or out.stopping):
            return
        batches = run.data.valid_batches(
            trainer.cfg, run.env, trainer.cfg.train.eval_iters * run.grad_accum
        )
        stats = PositionLosses(trainer.cfg.seq_len)
        evaluate_loss(run.module.model, batches, positions=stats)
        sums, counts = stats.sums.cpu(), stats.counts.cpu()
        for a, b in position_ranges(stats.length):
            n = float(counts[a:b].sum())
            if n:
                out.scalars[f"valid_position/{a}-{b}"] = float(sums[a:b].sum()) / n
        if self.writer is not None:
            self.writer.add_image(
                "valid_position/curve", curve_image(stats, out.step), out.step, dataformats="HWC"
            )
            self.writer.flush()

    def on_fit_end(self, trainer, exit_code) -> None:
        if self.writer is not None:
            self.writer.close()


__all__ = ["PositionEvaluation", "position_ranges"]
