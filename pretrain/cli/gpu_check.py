"""The GPU acceptance run: one command turns the plan into measured figures on one GPU.

    make gpu-check                                   # = python tools/gpu_check.py
    python tools/gpu_check.py                        # run or continue: the stages not done yet
    python tools/gpu_check.py --science              # also the RoPE-theta study (chunked)
    python tools/gpu_check.py --stage kernels        # one stage (again)
    python tools/gpu_check.py --fresh                # start over in a new results folder
    python tools/gpu_check.py --cpu-smoke            # every stage's code at tiny sizes on CPU
    python tools/gpu_check.py --report --results DIR --update-docs   # docs from saved results

Each call runs the stages left while their budgets fit in --budget seconds (default 540:
one 10-minute command), writes runs/gpu_check/<date>_<gpu>/results.json and results.md,
and prints a summary that flags every figure more than 5% off the planner's or the docs'
expectation. Exit codes: 0 all done and ok, 1 a stage failed (or the smoke's schema is
wrong), 2 a user error, 75 stages left: run the same command again.
The stages and their budgets: `--list`, and docs/gpu_check.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.gpucheck.runner import Options, run_check
from pretrain.gpucheck.stages import all_stages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every stage's code path at tiny sizes on CPU and check the result files' "
        "shape (what the test suite runs; no GPU figures)",
    )
    p.add_argument(
        "--science",
        action="store_true",
        help="also the character-level RoPE-theta study (theta 5000 and 10000, 3 seeds; "
        "needs Tiny Shakespeare, see --shakespeare)",
    )
    p.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this stage, even if done or interrupted before (repeatable; --list)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over: a new results folder (or the --results folder emptied)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="DIR",
        help="results folder (default: the newest runs/gpu_check/<date>_<device>, else a new one)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=540.0,
        metavar="SECONDS",
        help="start no stage whose budget does not fit in what is left of this many seconds "
        "(default 540: one 10-minute command with room to spare; the first stage always runs)",
    )
    p.add_argument(
        "--shakespeare",
        type=Path,
        default=None,
        metavar="PATH",
        help="Tiny Shakespeare's input.txt for --science (default: data/tinyshakespeare.txt, "
        "input.txt or ../shared/data/tinyshakespeare.txt)",
    )
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="write the tables into docs/gpu_check.md between its gpu-check markers "
        "(GPU results only)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: print the summary of --results DIR and rewrite its results.md",
    )
    p.add_argument("--list", action="store_true", help="list the stages and their budgets")
    args = p.parse_args(argv)
    if args.budget < 0:
        p.error(f"--budget {args.budget:g} must be >= 0 seconds")
    return args


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        total = 0
        for stage, _ in all_stages():
            extra = " (with --science)" if stage.science else ""
            print(f"{stage.name:<16} {stage.budget_s:>4} s  {stage.what}{extra}")
            total += 0 if stage.science else stage.budget_s
        print(f"{'total':<16} {total:>4} s without --science")
        return 0
    opts = Options(
        smoke=args.cpu_smoke,
        science=args.science,
        stages=tuple(args.stage),
        fresh=args.fresh,
        results=args.results,
        budget_s=args.budget,
        shakespeare=args.shakespeare,
        update_docs=args.update_docs,
        report_only=args.report,
    )
    return run_check(opts)
