"""Every plot the toolkit writes can be read: each plot function drawn on small synthetic
inputs (names as long as the shipped studies' runs have), then every text the renderer drew
(suptitle, titles, axis and tick labels, legends, notes) measured with `get_window_extent`:
none may reach past the canvas (the PNG cuts it off) or lie over another text. The boxes are
those of each figure's last draw, the one written to the PNG (or returned as pixels), not of
a redraw after the fact."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pretrain.analysis.frequency_use import FrequencyUse, LayerFrequencyUse, plot_heads, plot_layers

if TYPE_CHECKING:
    from matplotlib.transforms import Bbox

REPO = Path(__file__).resolve().parents[1]
# A text's box holds its glyphs and their side bearings: half a pixel is the rounding to the
# pixel grid. Two boxes may share a pixel's width (tick labels side by side) without harm.
TOLERANCE_PX = 0.5
OVERLAP_PX = 1.0
# Names as long as the shipped studies' longest: docs/img/position_surgery_usage_after.png's
# checkpoint, studies/partial_rope.yaml's longest run name and group.
SOURCE = "run cont_prope25_s1@step_0000200"
RUN = "llama1b_seq8192_rope0_qknorm"
LONG_SOURCE = f"run {RUN}@step_0100000"
GROUP = "model=llama1b,data=fineweb,seq=2048,rope=100,qknorm=off"


@dataclass
class Drawing:
    """One draw of a figure as the renderer made it: the canvas's box and, for every text (and
    legend) it drew, its name, its box and the texts a legend holds, in pixels."""

    canvas: Bbox
    texts: list[tuple[str, Bbox]] = field(default_factory=list)
    legend_texts: dict[int, set[int]] = field(default_factory=dict)  # legend -> its texts


class Renders:
    """The figures the plot functions closed (each saves or renders, then closes) and, for
    each, its last draw: the one written to the PNG or returned as pixels. Texts are counted
    as the renderer draws them, so tick labels outside the view, empty strings and hidden
    texts are not."""

    def __init__(self) -> None:
        self.closed: list = []
        self.last: dict[int, Drawing] = {}
        self.index: dict[int, int] = {}  # id(artist) -> its place in its drawing's texts

    def record(self, artist, renderer, name: str) -> None:
        drawing = self.last.get(id(artist.get_figure(root=True)))
        if drawing is not None:
            self.index[id(artist)] = len(drawing.texts)
            drawing.texts.append((name, artist.get_window_extent(renderer).frozen()))

    def drawing(self, fig) -> Drawing:
        assert id(fig) in self.last, "the figure was closed without being drawn"
        return self.last[id(fig)]


@pytest.fixture
def renders(monkeypatch) -> Renders:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    out = Renders()
    close, figure_draw, text_draw, legend_draw = plt.close, Figure.draw, Text.draw, Legend.draw

    def keep(fig=None):
        out.closed.append(fig)
        close(fig)

    def spy_figure(self, renderer):
        out.last[id(self)] = Drawing(self.bbox.frozen())
        return figure_draw(self, renderer)

    def spy_text(self, renderer):
        text_draw(self, renderer)
        if self.get_visible() and self.get_text().strip():
            out.record(self, renderer, repr(self.get_text()))

    def spy_legend(self, renderer):
        legend_draw(self, renderer)
        if self.get_visible():
            out.record(self, renderer, "the legend")
            texts = [*self.get_texts(), self.get_title()]
            drawing = out.last[id(self.get_figure(root=True))]
            drawing.legend_texts[out.index[id(self)]] = {
                out.index[id(t)] for t in texts if id(t) in out.index
            }

    monkeypatch.setattr(plt, "close", keep)
    monkeypatch.setattr(Figure, "draw", spy_figure)
    monkeypatch.setattr(Text, "draw", spy_text)
    monkeypatch.setattr(Legend, "draw", spy_legend)
    return out


def off_canvas(drawing: Drawing) -> list[str]:
    """One line per drawn text (or legend) that reaches past the figure's edge."""
    box = drawing.canvas
    out = []
    for name, ext in drawing.texts:
        over = {
            "left": box.x0 - ext.x0,
            "right": ext.x1 - box.x1,
            "bottom": box.y0 - ext.y0,
            "top": ext.y1 - box.y1,
        }
        sides = [f"{side} by {px:.1f} px" for side, px in over.items() if px > TOLERANCE_PX]
        if sides:
            out.append(f"{name} past the {', '.join(sides)}")
    return out


def overlaps(drawing: Drawing) -> list[str]:
    """One line per two drawn texts (or legends) whose boxes overlap: one written over the
    other (a legend and its own entries excepted)."""
    boxes = [ext.padded(-OVERLAP_PX) for _, ext in drawing.texts]
    out = []
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if j in drawing.legend_texts.get(i, ()) or i in drawing.legend_texts.get(j, ()):
                continue
            if boxes[i].overlaps(boxes[j]):
                out.append(f"{drawing.texts[i][0]} over {drawing.texts[j][0]}")
    return out


def assert_readable(renders: Renders, count: int) -> None:
    """Each of the `count` figures closed: no text past the canvas, none over another."""
    assert len(renders.closed) == count, f"{count} figure(s) expected, {len(renders.closed)} closed"
    for fig in renders.closed:
        drawing = renders.drawing(fig)
        assert drawing.texts, "no text drawn at all"
        problems = off_canvas(drawing) + overlaps(drawing)
        assert not problems, "text off the canvas or over other text:\n" + "\n".join(problems)


# ---------------------------------------------------------------- the check itself


def test_the_check_finds_text_off_the_canvas_or_over_other_text(renders):
    import matplotlib.pyplot as plt

    def problems(fig) -> tuple[list[str], list[str]]:
        fig.canvas.draw()
        return off_canvas(renders.drawing(fig)), overlaps(renders.drawing(fig))

    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    ax.set_title("a title far wider than the four inches of its figure, " * 2)
    ax.set_xlabel("x")
    ax.plot([0, 1], label="a line")
    fig.tight_layout()  # moves the axes, never the title
    (outside,), over = problems(fig)
    assert outside.startswith("'a title far wider") and "past the left by" in outside
    assert "right by" in outside and over == []

    ax.set_title("a short title")
    ax.legend(loc="upper left", bbox_to_anchor=(1.05, 1.0))  # right of the axes, no room made
    outside, over = problems(fig)
    assert [p.split(" past the right by ")[0] for p in outside] == ["'a line'", "the legend"]
    assert over == []  # the legend's own entry is not text over text

    ax.get_legend().remove()
    note = ax.text(0.5, 1.02, "a note", transform=ax.transAxes, ha="center")  # on the title
    outside, over = problems(fig)
    assert outside == [] and over == ["'a note' over 'a short title'"]

    note.remove()
    fig.legend(loc="outside right upper")  # constrained layout makes room for it
    fig.set_layout_engine("constrained")
    assert problems(fig) == ([], [])
    plt.close(fig)


# ---------------------------------------------------------------- frequency use


def frequency_use(
    layers: int, pairs: int, heads: int, nope: tuple[int, ...] = (), source: str = SOURCE
) -> FrequencyUse:
    """A map of `layers` layers (those in `nope` without positions), shares rising with j."""
    out = []
    for i in range(layers):
        rope = i not in nope
        p = pairs if rope else 0
        share = [
            [(j + 1 + h) / sum(k + 1 + h for k in range(p)) for j in range(p)] for h in range(heads)
        ]
        inv = [10000 ** (-j / max(p, 1)) for j in range(p)]
        out.append(
            LayerFrequencyUse(
                layer=i,
                rope=rope,
                rotary_dims=2 * p,
                head_dim=2 * pairs,
                theta=10000.0,
                spectrum="neox",
                heads=heads,
                kv_heads=heads,
                inv_freq=inv,
                scaled_inv_freq=None,
                per_head=share if rope else [],
                share_per_head=share if rope else [],
                pooled=[sum(col) / heads for col in zip(*share, strict=True)] if rope else [],
                pooled_share=[sum(col) / heads for col in zip(*share, strict=True)] if rope else [],
                passthrough_per_head=[0.0] * heads,
            )
        )
    return FrequencyUse(out, tokens=16384, source=source)


@pytest.mark.parametrize(
    "shape",
    [(4, 4, 4, ()), (6, 16, 4, (2, 5), LONG_SOURCE), (2, 2, 1, (1,), LONG_SOURCE)],
    ids=["docs_image", "panels_with_nope", "narrowest"],
)
def test_frequency_use_plots(renders, tmp_path, shape):
    use = frequency_use(*shape)
    plot_layers(use, tmp_path / "layers.png")
    plot_heads(use, tmp_path / "heads.png")
    assert_readable(renders, 2)


# ---------------------------------------------------------------- loss curves, compare_runs


def write_metrics(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def loss_rows(seed: int, group: int = 0, spikes: bool = False) -> list[dict]:
    """200 steps of a run: its loss falling, its downstream scores rising, 0.01 apart per seed
    and 0.1 per group."""
    rows = []
    for step in range(1, 201):
        d = 0.01 * seed + 0.1 * group
        row: dict = {"step": step, "train/loss": 2.0 + 8.0 / math.sqrt(step) + d}
        if step % 50 == 0:
            row["valid/loss"] = row["train/loss"] + 0.05
            row["downstream/hellaswag/acc_norm"] = 0.25 + step / 2000 + d
            row["downstream/wikitext/word_perplexity"] = 900.0 / step + 30 + 10 * d
            row["downstream/lambada_openai/acc"] = step / 1000 + d
        if spikes and step in (80, 81):
            row["spikes/loss"] = 9.0
            row["spikes/skipped"] = True
        if spikes and step == 120:
            row["spikes/rollback_from"] = 140
        rows.append(row)
    return rows


def test_loss_curves_plot(renders, tmp_path):
    from pretrain.eval.plots import plot_loss_curves

    runs = [
        write_metrics(tmp_path / f"{RUN}_s{s}", loss_rows(s, s, spikes=s == 1)) for s in (1, 2, 3)
    ]
    plot_loss_curves(runs, tmp_path / "loss.png", log_x=True)
    assert_readable(renders, 1)


def test_downstream_plot(renders, tmp_path):
    from pretrain.eval.compare import Group, RunSummary, plot_downstream

    groups = []
    for i, g in enumerate(("rope=100", "rope=25", GROUP)):
        runs = []
        for s in (1, 2):
            path = write_metrics(tmp_path / f"{g}_s{s}", loss_rows(s, i))
            runs.append(RunSummary(path=path, name=path.name, seed=s, group_key=g))
        groups.append(Group(g, runs))
    plot_downstream(groups, tmp_path / "downstream.png")
    assert_readable(renders, 1)


# ---------------------------------------------------------------- loss by position


def buckets(length: int) -> list[tuple[int, int]]:
    from pretrain.eval.positions import bucket_edges

    edges = bucket_edges(length)
    return list(zip(edges, edges[1:], strict=False))


def test_position_plots(renders, tmp_path):
    import torch

    from pretrain.eval.compare_positions import PositionCurve
    from pretrain.eval.position_plots import curve_image, plot_position_curves, plot_positions
    from pretrain.eval.positions import PositionLosses

    spans = buckets(2048)
    loss = [2.0 + 3.0 / math.sqrt(b) for _, b in spans]
    record = {
        "label": f"{RUN}@step_0100000",
        "train_seq_len": 512,
        "rope_scaling": {"type": "yarn", "factor": 8.0},
        "results": [
            {
                "length": n,
                "stride": s,
                "buckets": [
                    {"start": a, "end": b, "loss": v}
                    for (a, b), v in zip(spans, loss, strict=True)
                    if b <= n
                ],
            }
            for n, s in ((512, 512), (1024, 512), (2048, 2048))
        ],
    }
    plot_positions(record, tmp_path / "positions.png")

    stats = PositionLosses(1024)
    stats.counts = torch.full((1024,), 4.0, dtype=torch.float64)
    stats.sums = stats.counts * 2.5
    curve_image(stats, 123456)

    curves = [  # two lengths: each label says its own
        PositionCurve(f"{GROUP},{k}", 2048, 512, spans, loss, [0.01] * len(loss), 3)
        for k in ("a", "b")
    ]
    curves.append(PositionCurve(GROUP, 1024, 256, spans[:-3], loss[:-3], None, 1))
    plot_position_curves(curves, tmp_path / "curves.png")
    assert_readable(renders, 3)


# ---------------------------------------------------------------- passkey, RoPE cache, scaling


def test_passkey_plot(renders, tmp_path):
    from pretrain.eval.passkey import PasskeyGrid, plot_passkey

    lengths, depths = [256, 512, 1024, 2048, 4096, 8192], [0.0, 0.25, 0.5, 0.75, 1.0]
    correct = [[(i + j) % 5 for j in range(len(lengths))] for i in range(len(depths))]
    counts = [[4] * len(lengths) for _ in depths]
    info = {"train_len": 1024, "label": f"{RUN}@step_0100000"}
    plot_passkey(PasskeyGrid(lengths, depths, 4, 0, correct, counts, info=info), tmp_path / "p.png")
    one_cell = PasskeyGrid([512], [0.5], 1, 0, [[1]], [[1]], info={**info, "train_len": 512})
    plot_passkey(one_cell, tmp_path / "one_cell.png")  # the narrowest
    assert_readable(renders, 2)


def test_rope_cache_plot(renders, tmp_path):
    from pretrain.analysis.rope_cache import DEFAULT_FRACTIONS, plot_cache

    plot_cache(256, DEFAULT_FRACTIONS, "bf16", 16, 128 * 1024, tmp_path / "cache.png")
    plot_cache(64, (0.25, 1.0), "fp32", 2, 4096, tmp_path / "small.png")
    assert_readable(renders, 2)


def test_scaling_plot(renders, tmp_path):
    from pretrain.planner.comms import StepTime
    from pretrain.planner.network import HOPPER_IB
    from pretrain.planner.scaling import ScalePoint
    from pretrain.planner.scaling_report import scaling_plot

    def points(compute: float) -> list[ScalePoint]:
        out = []
        for k in range(3, 11):
            exposed = 1e-3 * 2**k / 8
            time = StepTime(compute / 2**k, 0.01, 2 * exposed, exposed)
            out.append(ScalePoint(2**k, 4, 1, (), time, 1000))
        return out

    results = {f"llama1b_rope{r}": points(8.0) for r in (0, 10, 25, 100)}
    results |= {f"llama7b_theta500000_rope{r}": points(50.0) for r in (0, 100)}
    title = f"llama1b_rope10: H100 SXM, {HOPPER_IB.name}"
    scaling_plot(results, tmp_path / "scaling.png", title)
    assert_readable(renders, 1)


# ---------------------------------------------------------------- a study's report


def test_study_loss_plot(renders, tmp_path):
    from pretrain.eval.plots import plot_group_losses

    groups = []
    for i, g in enumerate(("rope=100", "rope=25", GROUP)):
        runs = []
        for s in (1, 2):
            runs.append(tmp_path / "runs" / f"{g}_s{s}")
            write_metrics(runs[-1], loss_rows(s, i))
        groups.append((g, runs))
    plot_group_losses(groups, tmp_path / "loss_curves.png")
    assert_readable(renders, 1)


def test_position_surgery_example_plot(renders, tmp_path):
    """docs/examples/position_surgery.py's plot (docs/img/position_surgery.png)."""
    from pretrain.eval.compare_positions import parse_positions

    spec = importlib.util.spec_from_file_location(
        "position_surgery_example", REPO / "docs" / "examples" / "position_surgery.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    spans = buckets(4096)
    record = {
        "label": "x",
        "train_seq_len": 512,
        "results": [
            {
                "length": 4096,
                "stride": 4096,
                "windows": 2,
                "loss": 3.0,
                "tokens": 8190,
                "buckets": [
                    {"start": a, "end": b, "loss": 2.0 + 3.0 / math.sqrt(b), "tokens": 2 * (b - a)}
                    for a, b in spans
                ],
            }
        ],
    }

    class Seed:
        positions = parse_positions(record)

    by_group = {
        (start, pos): {1: Seed(), 2: Seed()}
        for start in ("base", "cont", "scratch")
        for pos in example.TEXT
    }
    steps = {"base": 400, "cont": 200, "scratch": 600}
    example.plot(by_group, 8, 512, steps, tmp_path / "surgery.png")
    assert_readable(renders, 1)
