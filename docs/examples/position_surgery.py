#!/usr/bin/env python
"""The table and plot of docs/studies.md, "A worked example: position surgery", from the runs
of studies/position_surgery.yaml once they are trained and evaluated (tools/evaluate.py
--val --per-position --lengths 1x,2x,4x,8x):

    python docs/examples/position_surgery.py                       # prints the markdown table
    python docs/examples/position_surgery.py --plot docs/img/position_surgery.png

Per variant (full RoPE, NeoX 25%, p-RoPE 25%, NoPE every 4th layer): the validation loss at
1x to 8x the training length of the runs continued from the full-RoPE base runs and of the
runs trained from scratch for as many steps, mean ± sample std over the seeds; the difference
of the means (continued - scratch) and that difference seed by seed (continued seed S against
scratch seed S). The plot: loss by position in the longest (8x) windows, 8 points per octave
(token-weighted: each point is the exact loss over its positions), one panel per variant,
continued and scratch as the mean over seeds with the range between the seeds shaded, the
base runs (full RoPE before the surgery) in grey.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pretrain.eval.compare import summarize_run  # noqa: E402
from pretrain.eval.compare_positions import mean_curve  # noqa: E402
from pretrain.eval.plots import save_png  # noqa: E402
from pretrain.study import load_study  # noqa: E402
from pretrain.study.status import run_folder  # noqa: E402

TEXT = {
    "rope100": "full RoPE (control)",
    "neox25": "NeoX 25% RoPE",
    "prope25": "p-RoPE 25%",
    "nope4": "NoPE every 4th layer",
}


def cell(xs: list[float]) -> str:
    if len(xs) > 1:
        return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"
    return f"{xs[0]:.3f}" if xs else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--study",
        default="studies/position_surgery.yaml",
        help="the study file (its runs: runs/ beside its studies/)",
    )
    p.add_argument("--plot", default=None, help="write the loss-by-position plot here (PNG)")
    p.add_argument("--per-octave", type=int, default=8)
    args = p.parse_args(argv)

    study = load_study(REPO / args.study)
    by_group: dict[tuple[str, str], dict[int, object]] = {}
    for run in study.runs:
        s = summarize_run(run_folder(run, study.repo))
        if s.positions is None:
            print(f"{run.name}: not evaluated yet (no positions.json)", file=sys.stderr)
            continue
        key = (run.labels["start"], run.labels.get("pos", "rope100"))
        by_group.setdefault(key, {})[run.seed] = s
    lengths = sorted(
        {n for g in by_group.values() for s in g.values() for n in s.positions.per_length()}
    )
    train_len = next(iter(next(iter(by_group.values())).values())).positions.train_seq_len
    titles = [f"{n} ({n // train_len}x)" for n in lengths]

    def losses(start: str, pos: str, n: int) -> dict[int, float]:
        return {
            seed: s.positions.per_length()[n].loss
            for seed, s in by_group.get((start, pos), {}).items()
        }

    rows = []
    base = [cell(list(losses("base", "rope100", n).values())) for n in lengths]
    rows.append(["base: full RoPE, before the surgery", "-", *base])
    for pos, text in TEXT.items():
        cont = [losses("cont", pos, n) for n in lengths]
        scratch = [losses("scratch", pos, n) for n in lengths]
        rows.append([text, "continued", *(cell(list(c.values())) for c in cont)])
        rows.append([text, "scratch", *(cell(list(s.values())) for s in scratch)])
        diffs = []
        for c, s in zip(cont, scratch, strict=True):
            seeds = sorted(set(c) & set(s))
            if not seeds:
                diffs.append("-")
                continue
            d = statistics.fmean(c.values()) - statistics.fmean(s.values())
            per_seed = ", ".join(f"{c[k] - s[k]:+.3f}" for k in seeds)
            diffs.append(f"{d:+.3f} ({per_seed})")
        rows.append([text, "continued - scratch (seed by seed)", *diffs])
    header = ["variant", "start", *titles]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")

    if args.plot:
        steps = {r.labels["start"]: r.config["train"]["train_iters"] for r in study.runs}
        plot(by_group, args.per_octave, train_len, steps, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def plot(by_group, per_octave: int, train_len: int, steps: dict[str, int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(start: str, pos: str):
        runs = by_group.get((start, pos))
        if not runs:
            return None
        return mean_curve(f"{start} {pos}", [s.positions for s in runs.values()], per_octave)

    def draw(ax, c, label: str, **style) -> None:
        style = {"linewidth": 1.4, **style}
        (line,) = ax.plot(c.x, c.mean, label=f"{label} ({c.n} seeds)", **style)
        if c.std is not None:  # two seeds: the range between them is mean ± std / sqrt(2)
            half = [s / 2**0.5 for s in c.std]
            lo = [m - h for m, h in zip(c.mean, half, strict=True)]
            hi = [m + h for m, h in zip(c.mean, half, strict=True)]
            ax.fill_between(c.x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True, sharey=True)
    base = curve("base", "rope100")
    for ax, (pos, text) in zip(axes.flat, TEXT.items(), strict=True):
        if base is not None:
            draw(ax, base, f"base: full RoPE, {steps['base']} steps", color="0.6", linewidth=1.0)
        for start, label, style in (
            ("cont", f"continued {steps['base']} + {steps['cont']}", {"color": "tab:blue"}),
            (
                "scratch",
                f"from scratch {steps['scratch']}",
                {"color": "tab:orange", "linestyle": "--"},
            ),
        ):
            c = curve(start, pos)
            if c is not None:
                draw(ax, c, label, **style)
        ax.axvline(train_len, color="black", linestyle=":", linewidth=1, label="training length")
        ax.set_xscale("log")
        ax.set_title(text, fontsize=11)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for ax in axes[1]:
        ax.set_xlabel("position in the window (tokens of context, log scale)")
    for ax in axes[:, 0]:
        ax.set_ylabel("validation loss (nats per token)")
    length = base.length if base is not None else "?"
    fig.suptitle(
        f"Position surgery: loss by position in {length}-token windows (8x the training "
        f"length), mean over 2 seeds, range shaded",
        fontsize=11,
    )
    fig.tight_layout()
    save_png(fig, out)


if __name__ == "__main__":
    sys.exit(main())
