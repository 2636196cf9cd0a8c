#!/usr/bin/env python
"""The tables and plot of docs/pair_selection.md, "Which pairs to keep, compared", from the runs
of studies/pair_selection.yaml once they are trained and evaluated (tools/evaluate.py --val
--lengths 1x,4x):

    python docs/examples/pair_selection.py                       # prints the markdown tables
    python docs/examples/pair_selection.py --plot docs/img/pair_selection.png

Per selection (strategy x pairs kept), seeds pooled (mean ± sample std):
- the first loss after the surgery: the training loss of a continued run's first step, the
  surgered base model on its first batch before any update;
- the validation loss at 1x and 4x the training length (128 and 512 tokens), of the runs
  continued from the full-RoPE base runs and of the same selection trained from scratch on
  as many tokens (Welch's t-test, unequal variances: continued against scratch);
- each continued selection against the continued full-RoPE control (Welch's t-test).
With two seeds a t-test has at most 1-2 degrees of freedom: read p as a coarse screen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pretrain.eval.compare import length_key, summarize_run  # noqa: E402
from pretrain.eval.plots import save_png  # noqa: E402
from pretrain.study import load_study  # noqa: E402
from pretrain.study.status import run_folder  # noqa: E402

STRATEGIES = ("high", "low", "uniform", "usage")
SIZES = (2, 4)


def cell(xs: list[float]) -> str:
    if len(xs) > 1:
        return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"
    return f"{xs[0]:.3f}" if xs else "-"


def welch(xs: list[float], ys: list[float]) -> str:
    """mean(xs) - mean(ys) and Welch's p (scipy; '-' with fewer than two values a side)."""
    if not xs or not ys:
        return "-"
    d = statistics.fmean(xs) - statistics.fmean(ys)
    if len(xs) < 2 or len(ys) < 2:
        return f"{d:+.3f}"
    from scipy import stats

    p = stats.ttest_ind(xs, ys, equal_var=False).pvalue
    return f"{d:+.3f} (p {p:.2g})"


def first_loss(run: Path) -> float | None:
    """The training loss of step 1 (metrics.jsonl), before the first update."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == 1 and "train/loss" in row:
            return float(row["train/loss"])
    return None


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def collect(study_file: Path) -> tuple[dict, int]:
    """{(start, pos): {seed: {'first': x, 'loss@N': y, ...}}} and the training length."""
    study = load_study(study_file)
    runs: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    train_len = 0
    for run in study.runs:
        folder = run_folder(run, study.repo)
        if not folder.is_dir():
            print(f"{run.name}: not trained yet", file=sys.stderr)
            continue
        s = summarize_run(folder)
        values = {k: v for k, v in s.values.items() if k.startswith("loss@")}
        if not values:
            print(f"{run.name}: not evaluated yet (tools/evaluate.py --lengths)", file=sys.stderr)
        first = first_loss(folder)
        if first is not None:
            values["first"] = first
        train_len = run.config["train"]["seq_len"]
        runs.setdefault((run.labels["start"], run.labels["pos"]), {})[run.seed] = values
    return runs, train_len


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--study",
        default="studies/pair_selection.yaml",
        help="the study file (its runs: runs/ beside its studies/)",
    )
    p.add_argument("--plot", default=None, help="write the bar plot here (PNG)")
    args = p.parse_args(argv)
    runs, train_len = collect(REPO / args.study)
    lengths = (train_len, 4 * train_len)

    def values(start: str, pos: str, key: str) -> list[float]:
        return [v[key] for _, v in sorted(runs.get((start, pos), {}).items()) if key in v]

    k1, k4 = (length_key(n) for n in lengths)
    rows = [
        [
            "full RoPE (16 of 16 pairs)",
            cell(values("cont", "full", "first")),
            cell(values("cont", "full", k1)),
            "-",
            cell(values("cont", "full", k4)),
            "-",
        ]
    ]
    for k in SIZES:
        for strategy in STRATEGIES:
            pos = f"{strategy}{k}"
            rows.append(
                [
                    f"{strategy}, {k} of 16 pairs",
                    cell(values("cont", pos, "first")),
                    cell(values("cont", pos, k1)),
                    cell(values("scratch", pos, k1)),
                    cell(values("cont", pos, k4)),
                    cell(values("scratch", pos, k4)),
                ]
            )
    n1, n4 = lengths
    print(
        table(
            [
                "selection",
                "first loss after surgery",
                f"continued, {n1} (1x)",
                f"scratch, {n1} (1x)",
                f"continued, {n4} (4x)",
                f"scratch, {n4} (4x)",
            ],
            rows,
        )
    )
    print()
    tests = []
    for k in SIZES:
        for strategy in STRATEGIES:
            pos = f"{strategy}{k}"
            tests.append(
                [
                    f"{strategy}, {k} of 16",
                    welch(values("cont", pos, k1), values("cont", "full", k1)),
                    welch(values("cont", pos, k4), values("cont", "full", k4)),
                    welch(values("cont", pos, k1), values("scratch", pos, k1)),
                    welch(values("cont", pos, k4), values("scratch", pos, k4)),
                ]
            )
    print(
        table(
            [
                "selection",
                "continued - continued full RoPE, 1x",
                "same, 4x",
                "continued - scratch, 1x",
                "same, 4x",
            ],
            tests,
        )
    )
    if args.plot:
        plot(values, lengths, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def plot(values, lengths: tuple[int, int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), layout="constrained")
    panels = (("first", "first loss after surgery"),) + tuple(
        (length_key(n), f"validation loss at {n} tokens ({n // lengths[0]}x)") for n in lengths
    )
    width = 0.38
    for ax, (key, title) in zip(axes, panels, strict=True):
        labels = [f"{s}\n{k}/16" for k in SIZES for s in STRATEGIES]
        for i, (start, color) in enumerate((("cont", "tab:blue"), ("scratch", "tab:orange"))):
            if key == "first" and start == "scratch":
                continue
            xs, means, errs = [], [], []
            for j, (k, s) in enumerate((k, s) for k in SIZES for s in STRATEGIES):
                got = values(start, f"{s}{k}", key)
                if got:
                    xs.append(j + (i - 0.5) * width)
                    means.append(statistics.fmean(got))
                    errs.append(statistics.stdev(got) if len(got) > 1 else 0.0)
            name = "continued" if start == "cont" else "from scratch"
            ax.bar(xs, means, width, yerr=errs, color=color, label=name, capsize=2)
        full = values("cont", "full", key)
        lo = min((b.get_height() for b in ax.patches), default=0)
        if full:
            ax.axhline(statistics.fmean(full), color="black", linestyle=":", label="full RoPE")
            lo = min(lo, statistics.fmean(full))
        ax.set_ylim(bottom=max(0.0, lo - 0.3))
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("nats per token")
        ax.legend(fontsize=7)
    fig.suptitle("Pair selections after surgery and from scratch (mean ± std over 2 seeds)")
    save_png(fig, out)


if __name__ == "__main__":
    sys.exit(main())
