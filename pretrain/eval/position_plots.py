"""Loss-by-position plots: the one drawing behind the offline tool's positions.png
(`plot_positions`), the in-training TensorBoard image (`curve_image`) and compare_runs'
--positions-plot (`plot_position_curves`), so that a bucket lands at the same x in all three.

The x-axis is log-scaled tokens of context: position p (0-based) predicts token p + 1 from
p + 1 tokens, so it is drawn at x = p + 1 (and position 0 at 1, where log x is defined).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pretrain.eval.plots import save_png

if TYPE_CHECKING:
    from matplotlib.figure import Figure


X_LABEL = "position in the window (tokens of context, log scale)"
Y_LABEL = "loss (nats per token)"


def position_x(start: int, end: int) -> float:
    """Where the bucket of 0-based positions [start, end) is drawn.

    Its positions hold start + 1 ... end tokens of context, which a log axis draws as the
    span [log(start + 1), log(end)]: the geometric centre sqrt((start + 1) * end) is the
    middle of that span, so a point sits as far (on screen) from either end of its bucket
    and buckets of equal width per octave come out evenly spaced. The arithmetic centre
    would lean each point towards the bucket's far end (more so the wider the bucket). A
    bucket of one position p is drawn at p + 1 exactly (sqrt of a perfect square is exact).
    """
    if not 0 <= start < end:
        raise ValueError(f"bucket [{start}, {end}) is empty or starts below 0")
    return math.sqrt((start + 1) * end)


@dataclass(frozen=True)
class PositionLine:
    """One curve: the loss of each bucket [start, end) of 0-based positions, ± std where
    given (shaded)."""

    spans: Sequence[tuple[int, int]]
    loss: Sequence[float]
    label: str | None = None
    std: Sequence[float] | None = None

    @property
    def x(self) -> list[float]:
        return [position_x(a, b) for a, b in self.spans]


def position_figure(
    lines: Iterable[PositionLine],
    *,
    title: str,
    train_seq_lens: Iterable[int] = (),
    figsize: tuple[float, float] = (8, 4.8),
    dpi: int = 100,
    title_size: float | None = None,
) -> Figure:
    """The figure every loss-by-position plot is: each line against `position_x` (log x), a
    dashed line at each training length. The caller saves (or renders) and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    for line in lines:
        x = line.x
        (drawn,) = ax.plot(x, line.loss, linewidth=1.3, label=line.label)
        if line.std is not None:
            lo = [m - s for m, s in zip(line.loss, line.std, strict=True)]
            hi = [m + s for m, s in zip(line.loss, line.std, strict=True)]
            ax.fill_between(x, lo, hi, color=drawn.get_color(), alpha=0.2, linewidth=0)
    # At x = L by position_x's rule: position L - 1, the last one training saw, is drawn at
    # L and position L at L + 1, so the line divides what training saw from extrapolation.
    train_seq_lens = sorted(set(train_seq_lens))
    for t in train_seq_lens:
        text = "training length" if len(train_seq_lens) == 1 else f"training length {t}"
        ax.axvline(t, color="black", linestyle="--", linewidth=1, label=text)
    ax.set_xscale("log")
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(Y_LABEL)
    ax.set_title(title, fontsize=title_size)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_positions(record: dict[str, Any], path: str | Path) -> Path:
    """positions.json's record (pretrain/eval/positions.py) as a PNG: one curve per length."""
    lines = [
        PositionLine(
            [(b["start"], b["end"]) for b in r["buckets"]],
            [b["loss"] for b in r["buckets"]],
            label=f"window {r['length']}"
            + (f", stride {r['stride']}" if r["stride"] != r["length"] else ""),
        )
        for r in record["results"]
    ]
    scaling = record.get("rope_scaling")
    extra = f", rope scaling {scaling['type']} x{scaling['factor']:g}" if scaling else ""
    fig = position_figure(
        lines,
        title=f"Loss by position: {record['label']}{extra}",
        train_seq_lens=[record["train_seq_len"]],
    )
    return save_png(fig, path)


def curve_image(stats: Any, step: int) -> np.ndarray:
    """The validation loss by position during training (`stats`: a PositionLosses of
    pretrain/eval/positions.py, which imports this module) as an HWC uint8 RGB array for
    TensorBoard (no training-length line: the window is the training length)."""
    import matplotlib.pyplot as plt

    buckets = stats.buckets()
    fig = position_figure(
        [PositionLine([(b.start, b.end) for b in buckets], [b.loss for b in buckets])],
        title=f"valid loss by position, step {step}",
        figsize=(6, 3.6),
        dpi=80,
    )
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image


def plot_position_curves(curves: list[Any], out: str | Path) -> Path:
    """compare_runs' curves (pretrain/eval/compare_positions.py), ± std shaded for several
    seeds, a dashed line at each training length. Returns the PNG."""
    lengths = {c.length for c in curves}
    lines = [
        PositionLine(
            c.spans,
            c.mean,
            label=(c.label if len(lengths) == 1 else f"{c.label} ({c.length} tokens)")
            + f", {c.n} seed(s)",
            std=c.std,
        )
        for c in curves
    ]
    window = f"{next(iter(lengths))}-token" if len(lengths) == 1 else "the longest"
    fig = position_figure(
        lines,
        title=f"loss by position, {window} disjoint windows (mean over seeds, ± std shaded)",
        train_seq_lens=[c.train_seq_len for c in curves],
        figsize=(9, 5.5),
        title_size=10,
    )
    return save_png(fig, out)
