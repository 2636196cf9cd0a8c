"""Loss curves of several runs in one PNG: loss spikes, skipped steps and rollbacks marked;
or of groups of runs (seeds), their mean and range.

Reads the run's metrics file only (train/loss, valid/loss, spikes/loss, spikes/skipped,
spikes/rollback_from), so it works on runs copied from a cluster without TensorBoard.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.run_layout import atomic_write, read_metrics


@dataclass
class Curves:
    name: str
    train: list[tuple[int, float]] = field(default_factory=list)
    valid: list[tuple[int, float]] = field(default_factory=list)
    spikes: list[tuple[int, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # steps whose update was withheld
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (to step, from step)


def read_curves(run: str | Path) -> Curves:
    run = Path(run)
    curves = Curves(run.name)
    for row in read_metrics(run):
        step = row["step"]
        for key, dest in (
            ("train/loss", curves.train),
            ("valid/loss", curves.valid),
            ("spikes/loss", curves.spikes),
        ):
            if key in row and row[key] is not None:
                dest.append((int(step), float(row[key])))
        if row.get("spikes/skipped"):
            curves.skipped.append(int(step))
        if row.get("spikes/rollback_from") is not None:
            curves.rollbacks.append((int(step), int(row["spikes/rollback_from"])))
    for seq in (curves.train, curves.valid, curves.spikes, curves.skipped, curves.rollbacks):
        seq.sort()
    return curves


def save_png(fig, out: str | Path, dpi: int = 120) -> Path:
    """Write a matplotlib figure as a PNG (atomically: a crash leaves the old file) and close it."""
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write(out, buf.getvalue(), fsync=False)
    return out


def _nearest_finite(losses: dict[int, float], step: int) -> float:
    """The loss at `step`, or at the nearest earlier step where it is finite."""
    finite = [(s, v) for s, v in losses.items() if s <= step and math.isfinite(v)]
    return max(finite)[1] if finite else float("nan")


def ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average that skips non-finite values (a spike's NaN keeps the
    last average; leading ones stay as they are)."""
    out, acc = [], None
    for v in values:
        if math.isfinite(v):
            acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc if acc is not None else v)
    return out


def plot_loss_curves(
    runs: list[str | Path], out: str | Path, smoothing: float = 0.1, log_x: bool = False
) -> Path:
    """Training loss (raw, faint; EMA-smoothed over the steps that updated, solid), validation
    loss (dots), spikes (red crosses), skipped steps (ticks) and rollbacks (a shaded span from the
    step returned to, to the step it happened at) of each run on one axis. Returns the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_spike = any_skip = any_rollback = False
    for i, run in enumerate(runs):
        c = read_curves(run)
        color = colors[i % len(colors)]
        if c.train:
            steps, losses = zip(*c.train, strict=True)
            ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
            # The smoothed curve follows what the model trained on: a skipped step's loss is
            # of a batch it never learned from (its raw value stays in the faint line).
            skipped = set(c.skipped)
            kept = [(s, v) for s, v in c.train if s not in skipped] or c.train
            steps, losses = zip(*kept, strict=True)
            ax.plot(steps, ema(list(losses), smoothing), color=color, linewidth=1.6, label=c.name)
        if c.valid:
            steps, losses = zip(*c.valid, strict=True)
            ax.plot(
                steps,
                losses,
                "o",
                color=color,
                markersize=4,
                markeredgecolor="black",
                markeredgewidth=0.5,
            )
        if c.spikes:
            steps, losses = zip(*c.spikes, strict=True)
            ax.plot(steps, losses, "x", color="red", markersize=8, markeredgewidth=2)
            any_spike = True
        if c.skipped:
            # Under the run's own curve (its loss at the skipped step may be NaN).
            known = dict(c.train)
            ys = [_nearest_finite(known, s) for s in c.skipped]
            ax.plot(c.skipped, ys, "|", color=color, markersize=14, markeredgewidth=2)
            any_skip = True
        for to_step, from_step in c.rollbacks:
            ax.axvspan(to_step, from_step, color=color, alpha=0.15, linewidth=0)
            ax.annotate(
                f"rollback {from_step}->{to_step}",
                (to_step, 1.0),
                xycoords=("data", "axes fraction"),
                textcoords="offset points",
                xytext=(2, -12 * (1 + i)),
                fontsize=7,
                color=color,
            )
            any_rollback = True
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    title = "training loss (EMA), validation loss (dots)"
    marks = [
        text
        for text, on in (
            ("loss spikes (red x)", any_spike),
            ("skipped steps (|)", any_skip),
            ("rollbacks (shaded)", any_rollback),
        )
        if on
    ]
    ax.set_title(title + "".join(", " + m for m in marks), fontsize=10)
    # Right of the axes: inside, it would cover the rollbacks' notes and the first steps.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_png(fig, out)


def plot_group_losses(groups: Sequence[tuple[str, Sequence[Path]]], out: str | Path) -> Path:
    """Training loss (EMA) and validation loss per group of runs (label, run folders), e.g.
    the seeds of one config: the mean over them as a line, the lowest to the highest shaded;
    at the steps every run logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (group, runs) in enumerate(groups):
        color = colors[i % len(colors)]
        curves = [read_curves(run) for run in runs]
        for ax, kind in ((ax_t, "train"), (ax_v, "valid")):
            series = [dict(getattr(c, kind)) for c in curves]
            if kind == "train":
                series = [dict(zip(s, ema(list(s.values()), 0.1), strict=True)) for s in series]
            steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if not steps:
                continue
            values = [[s[k] for s in series] for k in steps]
            mean = [sum(v) / len(v) for v in values]
            label = f"{group} ({len(series)} seed{'s' if len(series) > 1 else ''})"
            marker = "o" if kind == "valid" else None
            ax.plot(steps, mean, color=color, label=label, marker=marker, markersize=4)
            if len(series) > 1:
                lo, hi = [min(v) for v in values], [max(v) for v in values]
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
    ax_t.set_title("training loss (EMA), mean over seeds, range shaded", fontsize=10)
    ax_v.set_title("validation loss, mean over seeds, range shaded", fontsize=10)
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    # The first tenth of the steps (a loss near ln(vocab)) would flatten every difference
    # that matters: the axis runs from below the lowest final loss to the highest loss a
    # tenth of the way in.
    curves = [ln.get_ydata() for ln in ax_t.lines]
    if curves:
        low = min(y[-1] for y in curves)
        top = max(y[len(y) // 10] for y in curves)
        ax_t.set_ylim(low - 0.1 * (top - low), top)
    fig.tight_layout()
    return save_png(fig, out)
