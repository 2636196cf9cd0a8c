"""One x-position rule for loss by position (pretrain/eval/position_plots.py): the offline
tool's positions.png, the in-training TensorBoard image and compare_runs' --positions-plot
draw a bucket at the same x."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pretrain.eval.position_plots import position_x
from pretrain.eval.positions import (
    POSITIONS_JSON,
    LengthResult,
    PositionLosses,
    bucket_edges,
)

TRAIN_LEN = 256
WINDOW = 1024


def test_position_x_is_tokens_of_context_at_the_log_centre_of_a_bucket():
    # One position p: p + 1 tokens of context, exactly (position 0 at 1, not 0.5).
    assert [position_x(p, p + 1) for p in range(4096)] == [float(p + 1) for p in range(4096)]
    edges = bucket_edges(4 * WINDOW)
    xs = [position_x(a, b) for a, b in zip(edges, edges[1:], strict=False)]
    assert xs == sorted(set(xs))
    for (a, b), x in zip(zip(edges, edges[1:], strict=False), xs, strict=True):
        assert a + 1 <= x <= b
        # The middle of the bucket's span on a log axis.
        assert math.log(x) - math.log(a + 1) == pytest.approx(math.log(b) - math.log(x))
    # A wide bucket: 1-based positions 257 ... 304 are centred on sqrt(257 * 304) on a log
    # axis, left of their arithmetic centre 280.5.
    assert position_x(256, 304) == pytest.approx(279.51, abs=0.01)
    for empty in ((3, 3), (-1, 2)):
        with pytest.raises(ValueError, match="empty or starts below 0"):
            position_x(*empty)


def synthetic_stats() -> PositionLosses:
    """Per-position sums and counts as a model's evaluation fills them: every position's
    loss distinct, so each bucket's loss names it."""
    stats = PositionLosses(WINDOW)
    p = torch.arange(WINDOW, dtype=torch.float64)
    stats.counts = torch.full((WINDOW,), 8.0, dtype=torch.float64)
    stats.sums = stats.counts * (2.0 + 3.0 / (p + 1) + 0.1 * (p >= TRAIN_LEN) * torch.log2(p + 1))
    return stats


def curve_points(fig) -> dict[float, float]:
    """{loss: x} of the figure's one loss curve (not the 2-point training-length lines)."""
    (ax,) = fig.axes
    (line,) = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]
    return {float(y): float(x) for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)}


def test_the_three_plots_draw_position_p_at_the_same_x(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrain.cli.compare_runs import plot_position_curves
    from pretrain.eval.compare_positions import mean_curve, parse_positions
    from pretrain.eval.position_plots import curve_image  # what PositionEvaluation logs
    from pretrain.eval.positions import positions_record, write_positions

    closed = []
    close = plt.close

    def keep(fig=None):
        closed.append(fig)
        close(fig)

    # Every path closes its figure once drawn (save_png, curve_image): the figure keeps its
    # lines after plt.close, which only forgets it.
    monkeypatch.setattr(plt, "close", keep)

    stats = synthetic_stats()
    buckets = stats.buckets()
    record = positions_record(
        [LengthResult.of(stats, WINDOW, 1)],
        label="run@step_0000100",
        train_seq_len=TRAIN_LEN,
        rope_scaling=None,
        source="test",
    )
    offline_dir = tmp_path / "eval"
    files = write_positions(record, offline_dir)  # tools/evaluate.py --per-position
    image = curve_image(stats, 100)  # PositionEvaluation's TensorBoard image
    # compare_runs --positions-plot: the positions.json read back, one seed's mean curve.
    positions = parse_positions(json.loads((offline_dir / POSITIONS_JSON).read_text()))
    compare_png = plot_position_curves([mean_curve("rope10k", [positions])], tmp_path / "c.png")

    assert len(closed) == 3
    for png in (files[-1], compare_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype.name == "uint8"

    want = {b.loss: position_x(b.start, b.end) for b in buckets}
    assert len(want) == len(buckets)  # every bucket's loss distinct: it names the bucket
    offline, training, comparison = (curve_points(f) for f in closed)
    assert offline == training == comparison == want
    for p in (0, 1, 15, TRAIN_LEN - 1):
        assert want[buckets[p].loss] == p + 1
    wide = next(b for b in buckets if b.start == TRAIN_LEN)
    assert wide.end == 304 and want[wide.loss] == math.sqrt(257 * 304)

    # The training-length line: at x = 256, between position 255 (x = 256) and the first
    # position past it.
    for fig in (closed[0], closed[2]):
        (ax,) = fig.axes
        (marker,) = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 2]
        assert list(marker.get_xdata()) == [TRAIN_LEN, TRAIN_LEN]
