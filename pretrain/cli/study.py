"""Studies are files: plan, write, submit, watch and report a study (studies/NAME.yaml,
docs/studies.md).

    python tools/study.py plan studies/partial_rope.yaml [--gpu h100]   # fits? memory, GPU-hours
    python tools/study.py write studies/char_theta.yaml [--array [--max-running N]]
    python tools/study.py submit studies/NAME.yaml [--max-running N] [--only AXIS=LABEL] [--eval]
    python tools/study.py submit studies/NAME.yaml --executor local --parallel 2   # this machine
    python tools/study.py status studies/NAME.yaml [--watch]     # exit 1: a run failed
    python tools/study.py report studies/NAME.yaml [--baseline AXIS=LABEL]

`write` is idempotent: it lists the files it changed (none when everything is current).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.cli.study_runtime import RUNTIME_COMMANDS, add_runtime_commands, run_runtime_command
from pretrain.planner.gpus import DEFAULT_MFU
from pretrain.study.plan import format_plan_table, plan_rows
from pretrain.study.spec import load_study
from pretrain.study.write import study_files, write_study


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "plan",
        help="per run: parameters, tokens, steps, fits? and peak memory per GPU, GPU-hours, "
        "wall time on the study's Slurm layout; and the total",
    )
    p.add_argument("study", help="the study file, e.g. studies/partial_rope.yaml")
    p.add_argument(
        "--gpu",
        choices=("h100", "h200"),
        help="plan on this GPU (default: the study's gpu:, else h200)",
    )
    p.add_argument(
        "--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilization for the times"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p = sub.add_parser(
        "write",
        help="write every config and job script of the study; list the files that changed",
    )
    p.add_argument("study", help="the study file, e.g. studies/char_theta.yaml")
    p.add_argument(
        "--array",
        action="store_true",
        help="one Slurm job array for every run instead of one script per run",
    )
    p.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help="with --array: at most N runs at once (the array's %%N)",
    )
    add_runtime_commands(sub)  # submit, status, report: pretrain/cli/study_runtime.py
    args = parser.parse_args(argv)
    if getattr(args, "max_running", None) is not None and not args.array:
        parser.error("--max-running needs --array")
    if getattr(args, "mfu", None) is not None and not 0 < args.mfu <= 1:
        parser.error(f"--mfu {args.mfu} must be in (0, 1], e.g. 0.4")
    return args


@user_errors
def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `study plan ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = parse_args(argv)
    study = load_study(args.study)
    if args.command in RUNTIME_COMMANDS:
        return run_runtime_command(args, study)
    if args.command == "plan":
        rows = plan_rows(study, args.gpu, args.mfu, log=sys.stderr)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(format_plan_table(rows))
        return 0 if all(r["fits"] for r in rows) else 1
    changed = write_study(study, study.repo, array=args.array, max_running=args.max_running)
    for rel in changed:
        print(f"wrote {rel}")
    files = len(study_files(study, array=args.array, max_running=args.max_running))
    summary = f"{len(changed)} changed" if changed else "nothing changed"
    print(f"{study.name}: {len(study.runs)} runs, {files} files; {summary}")
    return 0
