"""`study submit`, `study status` and `study report`: the half of pretrain/cli/study.py that
runs a study and reads it back (pretrain/study/selection.py, slurm_submit.py,
local_executor.py, status.py, report.py).

    python tools/study.py submit studies/NAME.yaml [--max-running N] [--only AXIS=LABEL] [--eval]
    python tools/study.py submit studies/NAME.yaml --executor local --parallel 2
    python tools/study.py status studies/NAME.yaml [--watch [SECONDS]]
    python tools/study.py report studies/NAME.yaml [--baseline AXIS=LABEL]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pretrain.study.local_executor import local_gpus, run_locally
from pretrain.study.records import StudyUsageError
from pretrain.study.runs import Study, relative_path
from pretrain.study.selection import EVAL_ARGS_ENV, eval_arguments, select_runs
from pretrain.study.slurm_submit import submit_to_slurm
from pretrain.study.status import STATES, format_status_table, study_status

RUNTIME_COMMANDS = ("submit", "status", "report")


def add_runtime_commands(sub: argparse._SubParsersAction) -> None:
    """The parsers of submit, status and report under `study`'s subcommands."""
    p = sub.add_parser(
        "submit",
        help="submit the runs that are not done, queued or running (to Slurm, or run them "
        "here with --executor local); print the job ids",
        description="Submit every run of the study that is not completed, queued, running or "
        "requeued (nor diverged): not started, stopped, cancelled, failed and hung runs, each "
        "resuming from its newest checkpoint. Slurm is asked first, so a second submit submits "
        "nothing new.",
    )
    p.add_argument("study", help="the study file, e.g. studies/partial_rope.yaml")
    p.add_argument(
        "--executor",
        choices=("slurm", "local"),
        default="slurm",
        help="slurm: sbatch each run's job script (or the study's job array); local: train the "
        "runs on this machine, one process per run, in the foreground (default: slurm)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        default=None,
        dest="slurm_max_running",  # `write --max-running` is another option (the array's %N)
        help="slurm: at most N of the study's jobs run at once (each new job waits for the job "
        "N places before it; a job array gets %%N); default: the study's slurm.max_running, "
        "else no limit",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="AXIS=LABEL[,LABEL]",
        help="only the runs with these labels (repeat for several axes; seed=N and run=NAME "
        "work too), e.g. --only rope=0,0.25 --only seed=1",
    )
    p.add_argument(
        "--eval",
        action="store_true",
        help="evaluate each run after it trains (slurm: slurm/evaluate.sh chained with "
        "afterok, as slurm/submit.sh; local: tools/evaluate.py once the run completed); "
        "completed runs without an evaluation get one",
    )
    p.add_argument(
        "--eval-args",
        default=None,
        metavar="ARGS",
        help=f"tools/evaluate.py options for --eval, one string (default: ${EVAL_ARGS_ENV}, "
        "else the paper's lm-eval suite), e.g. '--tasks none --val --per-position'",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="local: train N runs at once (default 1); on CPU they share the cores",
    )
    p.add_argument(
        "--gpus",
        default=None,
        metavar="IDS",
        help="local: the GPUs to use, e.g. 0,1 (a run per GPU, round robin), or none for the "
        "CPU; default: CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists",
    )
    p.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="local: print each running run's step and loss this often (default 30)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="slurm: say what would be submitted, submit nothing"
    )

    p = sub.add_parser(
        "status",
        help="one row per run: state, step, losses, tokens/s, MFU, ETA, Slurm job; exit 1 "
        "when a run failed, hung or diverged",
        description="States: " + ", ".join(STATES) + " (docs/studies.md). Slurm is asked "
        "where it answers (squeue, then sacct or scontrol); otherwise the run folders speak. "
        "Exit code 1 when a run failed, hung or diverged, else 0.",
    )
    p.add_argument("study", help="the study file")
    p.add_argument(
        "--watch",
        nargs="?",
        const=30.0,
        type=float,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 30) until no run is queued, running or requeued",
    )
    p.add_argument(
        "--no-slurm",
        action="store_true",
        help="do not ask Slurm: read the run folders and the local executor's records only",
    )

    p = sub.add_parser(
        "report",
        help="tables, Welch t-tests and plots of the finished runs into studies/NAME/report/ "
        "(marked partial while runs are missing)",
    )
    p.add_argument("study", help="the study file")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="AXIS=LABEL[,AXIS=LABEL]",
        help="test every group against the group with these labels instead (default: the "
        "study's baseline:)",
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="write here instead of studies/NAME/report/"
    )
    p.add_argument("--no-plots", action="store_true", help="tables and CSVs only")
    p.add_argument(
        "--per-octave",
        type=int,
        default=8,
        metavar="K",
        help="the loss-by-position plot: about K points per octave of position, each the "
        "exact loss over its positions (default 8; 0: every bucket as evaluated)",
    )


def run_runtime_command(args: argparse.Namespace, study: Study) -> int:
    """Run submit, status or report; the program's exit code."""
    repo = Path(study.repo)
    if args.command == "status":
        return _status(study, repo, args.watch, False if args.no_slurm else None)
    if args.command == "submit":
        runs = select_runs(study, args.only)
        eval_args = eval_arguments(args.eval_args)
        if args.executor == "local":
            if args.slurm_max_running is not None or args.dry_run:
                raise StudyUsageError(
                    "--max-running and --dry-run are for Slurm; the local executor runs "
                    "--parallel N at once"
                )
            return run_locally(
                study,
                repo,
                runs,
                parallel=args.parallel,
                evaluate=args.eval,
                eval_args=eval_args,
                gpus=local_gpus(args.gpus),
                echo=_echo,
                progress_every=args.progress_every,
            )
        if args.parallel != 1 or args.gpus is not None:
            raise StudyUsageError(
                "--parallel and --gpus are for --executor local; on Slurm, --max-running N"
            )
        submit_to_slurm(
            study,
            repo,
            runs,
            max_running=args.slurm_max_running,
            evaluate=args.eval,
            eval_args=eval_args,
            dry_run=args.dry_run,
            echo=_echo,
        )
        return 0
    from pretrain.study.report import parse_baseline, write_study_report

    baseline = parse_baseline(args.baseline)
    if args.per_octave < 0:
        raise StudyUsageError(f"--per-octave {args.per_octave}: give 0 or more")
    report = write_study_report(
        study,
        repo,
        Path(args.out) if args.out else None,
        baseline,
        plots=not args.no_plots,
        per_octave=args.per_octave or None,
    )
    print(report.markdown)
    for path in report.files:
        print(f"wrote {relative_path(path, repo)}")
    if report.partial:
        print(f"partial report: {report.finished} of {report.total} runs finished")
    return 0


def _status(study: Study, repo: Path, watch: float | None, ask_slurm: bool | None) -> int:
    if watch is not None and watch <= 0:
        raise StudyUsageError(f"--watch {watch}: give a positive number of seconds")
    while True:
        status = study_status(study, repo, ask_slurm)
        table = format_status_table(status)
        if watch is None:
            print(table)
            return 1 if status.failed else 0
        if sys.stdout.isatty():
            print("\033[H\033[J", end="")  # clear the screen: the table stays in one place
        stamp = time.strftime("%H:%M:%S")
        print(f"{study.name} at {stamp} (every {watch:g} s; Ctrl-C to stop)\n{table}", flush=True)
        if not status.active:
            return 1 if status.failed else 0
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            return 1 if status.failed else 0


def _echo(text: str) -> None:
    print(text, flush=True)


__all__ = ["RUNTIME_COMMANDS", "add_runtime_commands", "run_runtime_command"]
