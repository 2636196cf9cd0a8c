"""The shipped studies' files: check and (re)write them, list the paper's runs.

    python tools/sweep.py write       # (re)write what studies/*.yaml of the toolkit generate
    python tools/sweep.py check       # exit 1 if a checked-in file differs from its study
    python tools/sweep.py list        # the paper's runs: seq len, batch layout, tokens
    python tools/sweep.py list --markdown   # the same as a markdown table (docs/reproduce.md)
    python tools/sweep.py run-dir CONFIG [--set key=value ...]   # print the run folder

The shipped studies are studies/partial_rope.yaml (the paper's 50 runs: configs/paper/,
slurm/NAME.sh), studies/char_theta.yaml (configs/char/CORPUS_thetaT.yaml, slurm/char_theta.sh)
and studies/nanogpt_rope_enwik8.yaml. Edit a study, then run `write`; any study of your own:
`python tools/study.py plan|write STUDY` (docs/studies.md).
"""

from __future__ import annotations

import argparse
import signal
import sys

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.config import add_set_option
from pretrain.sweep import (
    REPO,
    SHIPPED_STUDIES,
    check_configs,
    format_run_table,
    paper_runs,
    run_dir_of,
    shipped_stale_files,
    write_shipped,
)


@user_errors
def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `tools/sweep.py list | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "write", help="write every config and job script of the shipped studies; list what changed"
    )
    sub.add_parser("check", help="exit 1 and name the files that differ from their study")
    p = sub.add_parser(
        "list",
        help="print each paper run: seq len, global batch, micro batch, "
        "accumulation, tokens per step, total tokens, nodes x GPUs",
    )
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p = sub.add_parser("run-dir", help="print the run folder (logging.run_dir) of a config")
    p.add_argument("config", help="run config YAML")
    add_set_option(p, "train.train_iters=100")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "run-dir":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.command in ("write", "check") and not (REPO / "studies").is_dir():
        print(
            f"{REPO} is not a checkout of this repository: `write` and `check` work on the "
            f"studies/, configs/ and slurm/ folders of one; install it with pip install -e .",
            file=sys.stderr,
        )
        return 2
    studies = ", ".join(f"studies/{s}.yaml" for s in SHIPPED_STUDIES)
    if args.command == "write":
        changed = write_shipped()
        check_configs()
        for rel in changed:
            print(f"wrote {rel}")
        print(f"{studies}: {len(changed) or 'nothing'} changed")
        stale = [p for p in shipped_stale_files() if p not in changed]
        if stale:
            print(
                "no study writes these any more (delete them): " + " ".join(stale), file=sys.stderr
            )
            return 1
    elif args.command == "check":
        stale = shipped_stale_files()
        if stale:
            print(
                f"differs from its study ({studies}): "
                + " ".join(stale)
                + "\nrun: python tools/sweep.py write",
                file=sys.stderr,
            )
            return 1
        check_configs()
        print(f"every file of {studies} matches its study")
    elif args.command == "list":
        print(format_run_table(paper_runs(), markdown=args.markdown))
    else:
        # Arguments meant for main.py other than --set (e.g. --print-config) are ignored.
        print(run_dir_of(args.config, args.overrides))
    return 0
