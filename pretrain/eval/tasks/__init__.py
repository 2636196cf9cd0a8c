"""Task suites and the offline task configs shipped with the package.

Online, the harness's built-in tasks are used unchanged. Offline (`--data-dir`), each task
of the suite is this folder's YAML of the same name: the built-in task's prompt, choices,
target and metrics, reading `<task>.jsonl` from a prepared folder (convert.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.eval.tasks.convert import TASK_DATA, EvalDataError, prepare_task_data

TASKS_DIR = Path(__file__).resolve().parent

# The paper's suite: the Pythia evaluation tasks plus PubMedQA.
PAPER_SUITE: tuple[str, ...] = (
    "arc_challenge",
    "arc_easy",
    "logiqa",
    "lambada_openai",
    "lambada_standard",
    "piqa",
    "sciq",
    "pubmedqa",
    "winogrande",
    "wsc273",
)
SUITES: dict[str, tuple[str, ...]] = {"paper": PAPER_SUITE}


def resolve_tasks(spec: str) -> list[str]:
    """'paper' or 'a,b,c' (suites may be mixed with names) -> task names, in order."""
    out: list[str] = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        for task in SUITES.get(name, (name,)):
            if task not in out:
                out.append(task)
    if not out:
        raise EvalDataError(
            f"--tasks {spec!r} names no task; use 'paper' or a comma-separated list"
        )
    return out


def local_yaml(task: str) -> Path:
    path = TASKS_DIR / f"{task}.yaml"
    if not path.is_file():
        raise EvalDataError(
            f"task {task!r} has no offline config in {TASKS_DIR}; offline tasks: "
            f"{', '.join(sorted(p.stem for p in TASKS_DIR.glob('*.yaml')))}"
        )
    return path


def load_local_config(task: str) -> dict[str, Any]:
    """The packaged YAML of `task`, loaded by the harness's own YAML loader (functions resolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(local_yaml(task), resolve_func=True)


def local_task_configs(
    tasks: Sequence[str], data_dir: str | Path, prepared_dir: str | Path
) -> list[dict[str, Any]]:
    """Task configs for `lm_eval.simple_evaluate(tasks=...)` reading local data.

    Converts the files of `data_dir` into `prepared_dir/<task>.jsonl` and points each
    config's data_files at them (absolute paths, so the working directory does not matter).
    The metadata records which local file and split the rows came from.
    """
    for task in tasks:
        local_yaml(task)
    prepared = prepare_task_data(tasks, data_dir, prepared_dir)
    configs = []
    for task in tasks:
        cfg = copy.deepcopy(load_local_config(task))
        path, source = prepared[task]
        files = cfg.setdefault("dataset_kwargs", {}).setdefault("data_files", {})
        if len(files) != 1:
            raise EvalDataError(
                f"{local_yaml(task)}: dataset_kwargs.data_files must name one split"
            )
        split = next(iter(files))
        files[split] = str(path)
        meta = cfg.setdefault("metadata", {})
        meta["local_data"] = {
            "files": [str(Path(data_dir).resolve() / f) for f in source.files],
            "source_split": source.split,
            "harness_split": TASK_DATA[task].split,
        }
        configs.append(cfg)
    return configs


__all__ = [
    "PAPER_SUITE",
    "SUITES",
    "TASKS_DIR",
    "EvalDataError",
    "load_local_config",
    "local_task_configs",
    "resolve_tasks",
]
