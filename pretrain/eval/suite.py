"""The harness's task suite on our model: lm-eval's tasks, online or offline from local files,
run on a checkpoint (`run_harness`), and the same scoring for a training run's in-loop evaluation.

    results, skipped, truncated = run_harness({"path": "runs/NAME"}, ["piqa", "sciq"])

Online, tasks are the harness's built-in ones. With `data_dir`, each task reads local files
through the offline twins in pretrain/eval/tasks/ (same prompts), converted into a cache.
For training's in-loop downstream evaluation (pretrain/train/evaluators/downstream.py):
the same task configs loaded once (`local_tasks`), the same documents in every process
(`choose_examples`), the same harness call (`harness_on`) and the same figures
(`downstream_scalars`, `sample_loglikelihoods`). A checkpoint's whole evaluation, with
validation loss and the report, is pretrain/eval/checkpoint_eval.py's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.errors import UserError
from pretrain.eval.tasks import TASKS_DIR, local_task_configs
from pretrain.eval.tasks.convert import EvalDataError, find_source

log = logging.getLogger(__name__)


class EvalError(UserError, ValueError):
    """Bad evaluation input; the message names the flag, file or task and the fix."""


def prepared_data_dir(data_dir: Path) -> Path:
    """Where converted task files of `data_dir` are cached (stable, so the datasets
    library's own cache of them is reused)."""
    import hashlib

    root = Path(os.environ.get("PRETRAIN_CACHE", Path.home() / ".cache" / "pretrain"))
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return root / "eval_data" / key


def _check_online_tasks(tasks: list[str]):
    from lm_eval.tasks import TaskManager

    tm = TaskManager()
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        import difflib

        hints = [
            f"{t!r}"
            + (
                f" (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(t, tm.all_tasks, 1))
                else ""
            )
            for t in unknown
        ]
        raise EvalError(
            f"unknown task {', '.join(hints)} for --tasks; `lm_eval ls tasks` lists them"
        )
    return tm


NO_LOCAL_DATA = "no local data"


def run_harness(
    model_args: dict[str, Any],
    tasks: list[str],
    *,
    data_dir: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    skip_missing: bool = False,
    bootstrap_iters: int | None = None,
    lm=None,
    samples: dict[str, list[int]] | None = None,
    log_samples: bool = False,
) -> tuple[dict[str, Any], dict[str, str], tuple[int, int]]:
    """Run `lm_eval.simple_evaluate` on our model.

    Returns (results, skipped tasks -> why, (truncated requests, requests)). With
    `skip_missing`, tasks whose data files are missing, and tasks with continuations longer
    than the model's context, are skipped; without it they stop the evaluation with one line.
    `samples`: the documents to score per task (indices, as a training run's in-loop
    evaluation records them in RUN/downstream/examples.json); `log_samples` keeps each
    document's scores in results["samples"] (`downstream_scalars` reads them).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pretrain.eval.harness import ContinuationTooLong, PretrainLM  # registers "pretrain"

    skipped: dict[str, str] = {}
    if data_dir is not None:
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise EvalError(f"--data-dir {data_dir} is not a folder")
        for task in tasks:
            if not (TASKS_DIR / f"{task}.yaml").is_file():
                offline = sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))
                raise EvalError(
                    f"unknown task {task!r} for --tasks with --data-dir; tasks with "
                    f"local data: {', '.join(offline)}"
                )
            try:
                find_source(task, data_dir)
            except EvalDataError as e:
                if not skip_missing:
                    raise EvalError(f"{e} (or pass --skip-missing)") from None
                log.warning("skipping %s: %s", task, e)
                skipped[task] = NO_LOCAL_DATA
        tasks = [t for t in tasks if t not in skipped]
        if not tasks:
            raise EvalError(f"no task of --tasks has data in {data_dir}")
        specs: list[Any] = local_task_configs(tasks, data_dir, prepared_data_dir(data_dir))
        task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    else:
        task_manager = _check_online_tasks(tasks)
        specs = list(tasks)
    own = lm is None
    if own:  # built here rather than by name, so that a rerun without some tasks reuses it
        lm = PretrainLM(**model_args)
    names = [spec["task"] if isinstance(spec, dict) else spec for spec in specs]
    while True:
        try:
            results = lm_eval.simple_evaluate(
                model=lm,
                model_args=model_args if own else None,
                tasks=specs,
                num_fewshot=num_fewshot,
                limit=limit,
                samples={k: v for k, v in samples.items() if k in names} if samples else None,
                task_manager=task_manager,
                log_samples=log_samples,
                **({"bootstrap_iters": bootstrap_iters} if bootstrap_iters is not None else {}),
            )
            break
        except ContinuationTooLong as e:  # raised before any request is scored
            bad = [t for t in e.tasks if t in names]
            if not skip_missing or not bad or len(bad) < len(e.tasks):
                hint = (
                    f", or pass --skip-missing to skip {'them' if len(bad) > 1 else 'it'}"
                    if bad
                    else ""
                )
                raise EvalError(f"{e}{hint}") from None
            for task in bad:
                n, total, longest = e.tasks[task]
                log.warning(
                    "skipping %s: %d of its %d requests have continuations longer than "
                    "max_length=%d tokens (the longest %d)",
                    task,
                    n,
                    total,
                    e.max_length,
                    longest,
                )
                skipped[task] = f"continuations longer than the {e.max_length}-token context"
            specs = [sp for sp, name in zip(specs, names, strict=True) if name not in bad]
            names = [name for name in names if name not in bad]
            if not specs:
                raise EvalError(
                    f"every task of --tasks has continuations longer than the model's "
                    f"context (max_length={e.max_length}); nothing to evaluate"
                ) from None
    if own and results is not None:
        results["config"]["model"] = "pretrain"  # as `lm_eval --model pretrain` would record it
    truncated = (getattr(lm, "requests_truncated", 0), getattr(lm, "requests_scored", 0))
    return results, skipped, truncated


# ----------------------------------------------------------------------------- in-loop
# What a training run's in-loop evaluation (pretrain/train/evaluators/downstream.py) shares
# with tools/evaluate.py: the same task configs, the same harness call, the same figures.


def local_tasks(tasks: Sequence[str], data_dir: str | Path) -> tuple[Any, dict[str, Any]]:
    """(task manager, {task: lm-eval Task}) reading `data_dir`'s local data: the configs
    `run_harness(data_dir=...)` evaluates, loaded once (a run evaluates them many times)."""
    from lm_eval.tasks import TaskManager

    data_dir = Path(data_dir)
    specs = local_task_configs(tasks, data_dir, prepared_data_dir(data_dir))
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    loaded = manager.load(specs)["tasks"]
    for task in loaded.values():  # as simple_evaluate leaves them: zero-shot unless set
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
    return manager, {name: loaded[name] for name in tasks}


def choose_examples(task_objs: dict[str, Any], n: int, seed: int) -> dict[str, list[int]]:
    """`n` documents per task (all when it has fewer), sorted: a draw of its own generator
    seeded by (seed, task), so the choice is the same in every process and every run, and
    adding a task changes no other task's examples."""
    import random

    out = {}
    for name, task in task_objs.items():
        total = len(task.eval_docs)
        rng = random.Random(f"{seed}/{name}")  # a string seed hashes the same everywhere
        out[name] = sorted(rng.sample(range(total), min(n, total)))
    return out


def harness_on(
    lm: Any,
    task_objs: dict[str, Any],
    manager: Any,
    samples: dict[str, list[int]] | None,
) -> dict[str, Any] | None:
    """`lm_eval.simple_evaluate` as run_harness calls it, on loaded tasks, keeping each
    document's scores, and drawing from no global random generator (a training process's
    generators are the run's). None on ranks other than 0."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(task_objs.values()),
        task_manager=manager,
        samples=samples,
        log_samples=True,
        bootstrap_iters=0,
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
        verbosity="WARNING",
    )


def _gold(task: Any, doc: dict[str, Any]) -> int:
    """The index of the gold request of a multiple-choice document, as lm-eval's
    process_results finds it (the gold context for a task of several contexts)."""
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        gold = task.doc_to_choice(doc).index(gold)
    if isinstance(gold, list):  # several right answers: the first
        gold = gold[0]
    return int(gold)


def sample_loglikelihoods(results: dict[str, Any]) -> dict[str, dict[int, list[float]]]:
    """{task: {document index: the loglikelihood of each of its requests}} from results
    kept with log_samples."""
    out: dict[str, dict[int, list[float]]] = {}
    for task, examples in (results.get("samples") or {}).items():
        out[task] = {
            int(ex["doc_id"]): [float(r[0]) for r in ex["filtered_resps"]]
            for ex in examples
            if all(isinstance(r, tuple | list) for r in ex["filtered_resps"])
        }
    return out


def downstream_scalars(results: dict[str, Any], task_objs: dict[str, Any]) -> dict[str, float]:
    """{task/metric: value}: the harness's acc, acc_norm and perplexity, and bits per byte
    of the gold continuation (its summed loglikelihood over its UTF-8 bytes, over the
    task's documents) for every multiple-choice and loglikelihood task."""
    import math

    out: dict[str, float] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if name in ("acc", "acc_norm", "perplexity") and filt == "none":
                out[f"{task}/{name}"] = float(value)
        obj = task_objs.get(task)
        kind = obj.OUTPUT_TYPE if obj is not None else None
        nll, nbytes = 0.0, 0
        for ex in (results.get("samples") or {}).get(task, []):
            if kind == "multiple_choice":
                i = _gold(obj, ex["doc"])
            elif kind == "loglikelihood":
                i = 0
            else:
                break
            nll -= float(ex["filtered_resps"][i][0])
            nbytes += len(ex["arguments"][i][1].encode("utf-8"))
        if nbytes:
            out[f"{task}/bits_per_byte"] = nll / math.log(2) / nbytes
    return out
