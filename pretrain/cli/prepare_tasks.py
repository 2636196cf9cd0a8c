"""Prepare the paper's evaluation tasks from local files, for machines without the hub.

    python tools/prepare_tasks.py --data-dir ../shared/data/evals --output DIR [--skip-missing]

Finds each task's original file in --data-dir, converts it into exactly the rows of the
hub dataset the harness's task loads (pretrain/eval/tasks/convert.py says how, task by
task) and writes <task>.jsonl into --output, which `tools/evaluate.py --data-dir` and
`lm_eval --include_path` read. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.eval.tasks.convert import TASK_DATA, EvalDataError, find_source, prepare_task_data

log = logging.getLogger(__name__)


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="folder with the original task files")
    p.add_argument("--output", required=True, help="folder to write <task>.jsonl into")
    p.add_argument(
        "--tasks",
        default=",".join(TASK_DATA),
        help="comma-separated tasks (default: all with a local recipe)",
    )
    p.add_argument(
        "--skip-missing",
        action="store_true",
        help="skip tasks whose files are missing instead of stopping",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tasks = [t for t in args.tasks.split(",") if t]
    if args.skip_missing:
        present = []
        for task in tasks:
            try:
                find_source(task, args.data_dir)
                present.append(task)
            except EvalDataError as e:
                log.warning("skipping %s", e)
        tasks = present
    done = prepare_task_data(tasks, args.data_dir, args.output)
    for task, (path, source) in done.items():
        print(f"{task:18s} {path}  <- {', '.join(source.files)} ({source.split})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
