"""The paper's runs: generate their configs and Slurm job scripts from one grid.

    python tools/sweep.py write       # (re)write configs/paper/*.yaml and slurm/NAME.sh
    python tools/sweep.py check       # exit 1 if a checked-in file differs from the grid
    python tools/sweep.py list        # the runs: seq len, batch layout, tokens per step, total
    python tools/sweep.py list --markdown   # the same as a markdown table (docs/reproduce.md)
    python tools/sweep.py run-dir CONFIG [--set key=value ...]   # print the run folder

The grid lives in pretrain/sweep.py; edit it there, then run `write`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import ConfigError, add_set_option
from pretrain.sweep import (
    budget_warnings,
    char_configs,
    check_configs,
    format_run_table,
    paper_runs,
    run_dir_of,
    stale_files,
    write_files,
)

# The checkout this package lives in (an editable install): the grid writes its configs/ and
# slurm/ folders.
REPO = Path(__file__).resolve().parents[2]


@user_errors
def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `tools/sweep.py list | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("write", help="write every generated config and job script; list what changed")
    sub.add_parser("check", help="exit 1 and name the files that differ from the grid")
    p = sub.add_parser(
        "list",
        help="print each run: seq len, global batch, micro batch, "
        "accumulation, tokens per step, total tokens, nodes x GPUs",
    )
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p = sub.add_parser("run-dir", help="print the run folder (logging.run_dir) of a config")
    p.add_argument("config", help="run config YAML")
    add_set_option(p, "train.train_iters=100")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "run-dir":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    try:
        # A run whose tokens differ from its grid's budget is legal (a deliberate change) but
        # never silent: every command says so before it does anything else.
        for line in budget_warnings():
            print(f"warning: {line}", file=sys.stderr)
        if args.command in ("write", "check") and not (REPO / "configs" / "models").is_dir():
            print(
                f"{REPO} is not a checkout of this repository: `write` and `check` work on the "
                f"configs/ and slurm/ folders of one; install it with pip install -e .",
                file=sys.stderr,
            )
            return 2
        if args.command == "write":
            changed = write_files(REPO)
            check_configs(REPO)
            for rel in changed:
                print(f"wrote {rel}")
            print(
                f"{len(paper_runs())} paper runs and {len(char_configs())} char configs; {len(changed)} file(s) changed"
            )
            stale = [p for p in stale_files(REPO) if p not in changed]
            if stale:
                print("not in the grid any more (delete them): " + " ".join(stale), file=sys.stderr)
                return 1
        elif args.command == "check":
            stale = stale_files(REPO)
            if stale:
                print(
                    "differs from the grid in pretrain/sweep.py: "
                    + " ".join(stale)
                    + "\nrun: python tools/sweep.py write",
                    file=sys.stderr,
                )
                return 1
            check_configs(REPO)
            print(
                f"{len(paper_runs())} paper runs and {len(char_configs())} char configs match the grid"
            )
        elif args.command == "list":
            print(format_run_table(markdown=args.markdown))
        else:
            # Arguments meant for main.py other than --set (e.g. --print-config) are ignored.
            print(run_dir_of(args.config, args.overrides))
    except ValueError as e:  # a run of the grid that cannot be laid out (pretrain/sweep.py)
        if isinstance(e, ConfigError):
            raise  # one line from user_errors
        print(f"grid error: {e}", file=sys.stderr)
        return 2
    return 0
