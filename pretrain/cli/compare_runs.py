"""Compare runs: benchmark results, validation loss and loss at each evaluated length in one
report, mean ± std over seeds.

    python tools/compare_runs.py runs/llama1b_rope10_s1 runs/llama1b_rope10_s2 runs/llama1b_nope_s1
    python tools/compare_runs.py runs/* --csv compare.csv --markdown compare.md --plot losses.png
    python tools/compare_runs.py runs/char_theta*_s* --baseline char_theta10000   # Welch t-tests
    python tools/compare_runs.py runs/theta*_s* --positions-plot by_position.png  # loss by position
    python tools/compare_runs.py runs/theta*_s* --positions --baseline theta10000  # t-tests per length
    python tools/compare_runs.py runs/theta*_s* --positions --rope-scaling yarn:8    # evaluated with YaRN

Reads each run's config (seed; runs equal but for the seed form one group), its
metrics (final and best valid/loss, valid/bits_per_byte), the newest
eval/<step>/lm_eval_results.json written by tools/evaluate.py and the newest
eval/<step>/positions.json written by `tools/evaluate.py --val --per-position --lengths 1x,2x,4x,8x`
(the table "Loss at each length"; a run without one shows as missing). Accuracies are the
paper's (acc_norm for ARC, LogiQA, PIQA, SciQ; acc for the others).
"""

import argparse
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.eval.compare import (
    compare,
    markdown_report,
    plot_downstream,
    position_curves,
    to_csv,
)
from pretrain.eval.lengths import parse_rope_scaling, scaling_tag
from pretrain.eval.plots import plot_loss_curves
from pretrain.eval.position_plots import plot_position_curves
from pretrain.run_layout import atomic_write


def _write(path: str, text: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, text, fsync=False)


@user_errors
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (runs/NAME)")
    p.add_argument(
        "--eval-step",
        type=int,
        default=None,
        help="use the evaluation of this checkpoint step (default: each run's newest)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="config group (or one of its runs) to test every other group against "
        "with Welch's t-test on best and final validation loss, and on the loss at each "
        "evaluated length (needs >= 2 seeds each)",
    )
    p.add_argument("--markdown", default=None, help="also write the markdown tables to this file")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also plot every run's training and validation loss to this PNG, with loss spikes, "
        "skipped steps and rollbacks marked",
    )
    p.add_argument(
        "--csv",
        default=None,
        help="write a CSV: one row per run and one per config group (with *_std columns), and "
        "one per group and evaluated length (kind 'length')",
    )
    p.add_argument(
        "--positions",
        action="store_true",
        default=None,
        help="include the table of loss at each evaluated length from eval/<step>/positions.json "
        "(an error if no run has one; without the flag, included when some run has one)",
    )
    p.add_argument(
        "--positions-plot",
        default=None,
        metavar="PNG",
        help="also plot each group's loss by position (log x, mean ± std over seeds) at the "
        "longest length it was evaluated at with disjoint windows, to this PNG",
    )
    p.add_argument(
        "--per-octave",
        type=int,
        default=None,
        metavar="K",
        help="with --positions-plot: merge the buckets into about K per octave of position "
        "(token-weighted, so each point is the exact loss over its positions) for a smoother "
        "curve; default: the buckets as evaluated (every position below 256)",
    )
    p.add_argument(
        "--downstream-plot",
        default=None,
        metavar="PNG",
        help="also plot the in-loop downstream metrics (downstream.* of the runs' configs) "
        "against tokens trained, one panel per task and metric, each group's mean over its "
        "seeds with a ± std band, to this PNG",
    )
    p.add_argument(
        "--rope-scaling",
        default=None,
        metavar="SPEC",
        help="read the evaluations made with this --rope-scaling of tools/evaluate.py "
        "(RUN/eval/<step>_yarn8/) instead of the model's own (default: none)",
    )
    args = p.parse_args(argv)
    scaling = scaling_tag(parse_rope_scaling(args.rope_scaling))
    runs, groups = compare(args.runs, args.eval_step, scaling)
    report = markdown_report(runs, groups, args.baseline, args.positions)
    if args.per_octave is not None and args.per_octave < 1:
        p.error(f"--per-octave {args.per_octave}: give a whole number of buckets >= 1, e.g. 8")
    curves = (
        position_curves(groups, args.per_octave) if args.positions_plot else None
    )  # errors before writing
    print(report)
    if args.markdown:
        _write(args.markdown, report)
        print(f"wrote {args.markdown}")
    if args.csv:
        _write(args.csv, to_csv(runs, groups))
        print(f"wrote {args.csv}")
    if args.plot:
        print(f"wrote {plot_loss_curves(args.runs, args.plot)}")
    if curves is not None:
        print(f"wrote {plot_position_curves(curves, args.positions_plot)}")
    if args.downstream_plot:
        print(f"wrote {plot_downstream(groups, args.downstream_plot)}")
    return 0
