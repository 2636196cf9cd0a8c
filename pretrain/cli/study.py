"""Studies are files: plan, write, list, submit, watch and report a study (studies/NAME.yaml),
e.g. `python tools/study.py submit studies/NAME.yaml --executor local`. What each command does
and prints: docs/studies.md; its flags: `study COMMAND --help`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import add_set_option, load_config
from pretrain.planner.gpus import DEFAULT_MFU
from pretrain.study import plan as study_plan
from pretrain.study.local_executor import LocalExecutor, local_gpus
from pretrain.study.records import StudyUsageError
from pretrain.study.runs import Study, relative_path
from pretrain.study.selection import select_runs
from pretrain.study.slurm_submit import submit_to_slurm
from pretrain.study.spec import load_study
from pretrain.study.status import State, format_status_table, study_status
from pretrain.study.write import stale_files, study_files, write_study

_echo = functools.partial(print, flush=True)
EVAL_ARGS_ENV = "PRETRAIN_EVAL_ARGS"  # --eval-args' default, as slurm/submit.sh reads it


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description or help)
        p.add_argument("study", help="the study file, e.g. studies/partial_rope.yaml")
        return p

    def flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
        p.add_argument(name, action="store_true", help=help)

    p = command("plan", "per run: peak GPU memory, fits?, GPU-hours; exit 1 when one does not fit")
    p.add_argument("--gpu", choices=("h100", "h200"), help="default: the study's gpu:, else h200")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="the MFU the times assume")
    flag(p, "--json", "print the rows as JSON")
    flag(p, "--fresh", "trace every run again, not from studies/NAME/plan_cache/")
    p = command("write", "write the study's configs and job scripts; list the files that changed")
    flag(p, "--array", "one Slurm job array instead of a script per run")
    p.add_argument(
        "--max-running", type=int, metavar="N", help="with --array: at most N runs at once"
    )
    flag(p, "--check", "write nothing; exit 1 listing the files that are not as written")
    p = command("list", "per run: seq len, batch layout, tokens per step and in all, nodes x GPUs")
    flag(p, "--markdown", "print a markdown table")
    p = sub.add_parser("run-dir", help="print a config's run folder, after its --set (slurm/*.sh)")
    p.add_argument("config", help="run config YAML")
    add_set_option(p, "train.train_iters=100")
    p = command(
        "submit",
        "submit the runs that are not done, queued or running (to Slurm, or run them here)",
        "Submit each run that is not started, stopped, cancelled, failed or hung, resuming from "
        "its newest checkpoint; what each flag does: docs/studies.md, submit.",
    )
    p.add_argument(
        "--executor",
        choices=("slurm", "local"),
        default="slurm",
        help="slurm (default): sbatch the study's job scripts; local: train the runs here, in "
        "the foreground",
    )
    p.add_argument(
        "--max-running", type=int, metavar="N", help="slurm: at most N of the study's jobs at once"
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="AXIS=LABEL[,LABEL]",
        help="only the runs with these labels (repeatable; seed=N and run=NAME too)",
    )
    flag(p, "--eval", "evaluate each run once it completed, and completed runs not evaluated yet")
    p.add_argument(
        "--eval-args",
        metavar="ARGS",
        default=os.environ.get(EVAL_ARGS_ENV, ""),
        help=f"tools/evaluate.py options, one string (default: ${EVAL_ARGS_ENV})",
    )
    p.add_argument(
        "--parallel", type=int, default=1, metavar="N", help="local: train N runs at once"
    )
    p.add_argument("--gpus", metavar="IDS", help="local: 0,1 or none (default: every visible GPU)")
    p.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="local: print where each run is this often (default 30)",
    )
    flag(p, "--dry-run", "slurm: say what would be submitted, submit nothing")
    p = command(
        "status",
        "one row per run: state, step, losses, tokens/s, MFU, ETA, job; exit 1: a run failed",
        f"States: {', '.join(State)} (docs/studies.md). Exit code 1 when a run failed, hung "
        "or diverged, else 0.",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        const=30.0,
        type=float,
        metavar="SECONDS",
        help="refresh every SECONDS (default 30) while a run is queued or running",
    )
    flag(p, "--no-slurm", "ask no Slurm: the run folders and the local records only")
    p = command("report", "tables, Welch t-tests and plots of the finished runs")
    p.add_argument(
        "--baseline",
        metavar="AXIS=LABEL[,AXIS=LABEL]",
        help="test every group against this one (default: the study's baseline:)",
    )
    p.add_argument("--out", metavar="DIR", help="write here instead of studies/NAME/report/")
    flag(p, "--no-plots", "tables and CSVs only")
    p.add_argument(
        "--per-octave",
        type=int,
        default=8,
        metavar="K",
        help="positions.png: K points per octave (default 8; 0: every bucket)",
    )
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "run-dir":  # run-dir gets main.py's arguments: it reads --set
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "write" and args.max_running is not None and not args.array:
        parser.error("--max-running needs --array")
    if getattr(args, "mfu", None) is not None and not 0 < args.mfu <= 1:
        parser.error(f"--mfu {args.mfu} must be in (0, 1], e.g. 0.4")
    return args


@user_errors
def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `study plan ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = parse_args(argv)
    if args.command == "run-dir":
        print(load_config(args.config, args.overrides).logging.run_dir)
        return 0
    study = load_study(args.study)
    if args.command == "list":
        print(study_plan.format_run_table(study, markdown=args.markdown))
        return 0
    if args.command == "plan":
        # study/plan.py loads the planner (and torch) only inside the functions that trace.
        rows = study_plan.plan_rows(study, args.gpu, args.mfu, log=sys.stderr, fresh=args.fresh)
        print(json.dumps(rows, indent=1) if args.json else study_plan.format_plan_table(rows))
        return 0 if all(r["fits"] for r in rows) else 1
    commands = {"write": _write, "submit": _submit, "status": _status, "report": _report}
    return commands[args.command](study, args)


def _write(study: Study, args: argparse.Namespace) -> int:
    """`write`, or with --check nothing written and exit 1 unless every file is as `write`
    would write it; both list the files that are not (after a write: those no run writes)."""
    layout = {"array": args.array, "max_running": args.max_running}
    changed = [] if args.check else write_study(study, study.repo, **layout)
    for rel in changed:
        print(f"wrote {rel}")
    files = study_files(study, **layout)
    stale = stale_files([study], study.repo, **layout)
    if not args.check or not stale:
        done = "every file is current" if args.check else f"{len(changed) or 'nothing'} changed"
        print(f"{study.name}: {len(study.runs)} runs, {len(files)} files; {done}")
    if stale:
        print(f"{study.name}: {len(stale)} files are not what the study writes:", file=sys.stderr)
    for rel in stale:
        if rel not in files:
            why = "no run writes it any more (delete it)"
        else:
            why = "differs" if (study.repo / rel).is_file() else "missing"
        print(f"  {rel}: {why}", file=sys.stderr)
    if not (args.check and stale):
        return 0
    again = f"python tools/study.py write {args.study}"
    if args.array:
        again += " --array" + (f" --max-running {args.max_running}" if args.max_running else "")
    print(f"run: {again}", file=sys.stderr)
    return 1


def _submit(study: Study, args: argparse.Namespace) -> int:
    repo, runs = Path(study.repo), select_runs(study, args.only)
    eval_args = shlex.split(args.eval_args)
    if args.executor == "local":
        if args.max_running is not None or args.dry_run:
            raise StudyUsageError(
                "--max-running and --dry-run are for Slurm; the local executor runs "
                "--parallel N at once"
            )
        gpus = local_gpus(args.gpus)
        executor = LocalExecutor(
            study, repo, args.eval, eval_args, _echo, gpus, args.parallel, args.progress_every
        )
        return executor.run(runs)
    if args.parallel != 1 or args.gpus is not None:
        raise StudyUsageError(
            "--parallel and --gpus are for --executor local; on Slurm, --max-running N"
        )
    submit_to_slurm(
        study, repo, runs, args.max_running, args.eval, eval_args, args.dry_run, echo=_echo
    )
    return 0


def _status(study: Study, args: argparse.Namespace) -> int:
    watch, ask_slurm = args.watch, False if args.no_slurm else None
    if watch is not None and watch <= 0:
        raise StudyUsageError(f"--watch {watch}: give a positive number of seconds")
    while True:
        status = study_status(study, Path(study.repo), ask_slurm)
        table = format_status_table(status)
        if watch is not None:
            if sys.stdout.isatty():
                print("\033[H\033[J", end="")  # clear the screen: the table stays in one place
            stamp = time.strftime("%H:%M:%S")
            table = f"{study.name} at {stamp} (every {watch:g} s; Ctrl-C to stop)\n{table}"
        print(table, flush=True)
        if watch is None or not status.active:
            return 1 if status.failed else 0
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            return 1 if status.failed else 0


def _report(study: Study, args: argparse.Namespace) -> int:
    from pretrain.study.report import parse_baseline, write_study_report

    if args.per_octave < 0:
        raise StudyUsageError(f"--per-octave {args.per_octave}: give 0 or more")
    repo, out = Path(study.repo), Path(args.out) if args.out else None
    baseline, per_octave = parse_baseline(args.baseline), args.per_octave or None
    report = write_study_report(
        study, repo, out, baseline, plots=not args.no_plots, per_octave=per_octave
    )
    print(report.markdown)
    for path in report.files:
        print(f"wrote {relative_path(path, repo)}")
    if report.partial:
        print(f"partial report: {report.finished} of {report.total} runs finished")
    return 0
