"""Compare runs: benchmark results and validation loss in one table, mean ± std over seeds.

    python tools/compare_runs.py runs/llama1b_rope10_s1 runs/llama1b_rope10_s2 runs/llama1b_nope_s1
    python tools/compare_runs.py runs/* --csv compare.csv --markdown compare.md --plot losses.png
    python tools/compare_runs.py runs/char_theta*_s* --baseline char_theta10000   # Welch t-tests

Reads each run's config (seed; runs equal but for the seed form one group), its
metrics (final and best valid/loss, valid/bits_per_byte) and the newest
eval/<step>/lm_eval_results.json written by tools/evaluate.py. Accuracies are the paper's
(acc_norm for ARC, LogiQA, PIQA, SciQ; acc for the others).
"""

import argparse
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.eval.compare import compare, markdown_report, to_csv
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
        "with Welch's t-test on best and final validation loss (needs >= 2 seeds each)",
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
        help="write a CSV: one row per run and one per config group (with *_std columns)",
    )
    args = p.parse_args(argv)
    runs, groups = compare(args.runs, args.eval_step)
    report = markdown_report(runs, groups, args.baseline)
    print(report)
    if args.markdown:
        _write(args.markdown, report)
        print(f"wrote {args.markdown}")
    if args.csv:
        _write(args.csv, to_csv(runs, groups))
        print(f"wrote {args.csv}")
    if args.plot:
        from pretrain.eval.plots import plot_loss_curves

        print(f"wrote {plot_loss_curves(args.runs, args.plot)}")
    return 0
