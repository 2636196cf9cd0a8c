"""Evaluate a checkpoint: the harness's task suite and/or validation loss, written to the run.

Outputs go to RUN/eval/<step tag>/ (or `output`):
    lm_eval_results.json   the harness's results JSON, unchanged
    valid_metrics.json     validation loss, perplexity, bits per token/byte (with --val)
    positions.json/.csv/.png  loss by position (--val --per-position) and at each length
                           (--lengths), with the curve
    results.md             the paper's accuracy table, the LAMBADA perplexity table,
                           and the validation figures

Online, tasks are the harness's built-in ones. With `data_dir`, each task reads local files
through the offline twins in pretrain/eval/tasks/ (same prompts), converted into a cache.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError, DataConfig, RopeScalingConfig, from_dict, to_dict
from pretrain.data.documents import DocumentSwitches
from pretrain.errors import UserError
from pretrain.eval.lengths import (
    LengthError,
    check_lengths,
    parse_lengths,
    parse_rope_scaling,
    scaling_tag,
    train_length,
    valid_entries,
)
from pretrain.eval.metrics import bytes_per_token, evaluate_loss
from pretrain.eval.positions import (
    POSITIONS_CSV,
    POSITIONS_PNG,
    LengthResult,
    PositionLosses,
    positions_record,
    positions_table,
    write_positions,
)
from pretrain.eval.tables import fmt, markdown_table, paper_tables
from pretrain.eval.tasks import TASKS_DIR, local_task_configs, resolve_tasks
from pretrain.eval.tasks.convert import EvalDataError, find_source
from pretrain.run_layout import CHECKPOINTS_DIR, CONFIG_FILE, EVAL_DIR, atomic_write
from pretrain.weights import WeightsError, find_weights_dir

log = logging.getLogger(__name__)

RESULTS_JSON = "lm_eval_results.json"
VALID_JSON = "valid_metrics.json"
RESULTS_MD = "results.md"


class EvalError(UserError, ValueError):
    """Bad evaluation input; the message names the flag, file or task and the fix."""


@dataclass
class EvalOutcome:
    output_dir: Path
    weights_dir: Path
    results: dict[str, Any] | None = None  # the harness's results dict
    valid: dict[str, float] | None = None
    positions: dict[str, Any] | None = None  # positions.json's record (per position, lengths)
    files: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # task -> why it was not run
    truncated: tuple[int, int] = (0, 0)  # (requests whose context was cut on the left, requests)


def default_output_dir(weights_dir: Path, scaling: RopeScalingConfig | None = None) -> Path:
    """RUN/eval/<step tag> for a checkpoint of a run; WEIGHTS/eval otherwise. An evaluation
    with RoPE scaling gets its own folder (<step tag>_yarn4), so it never overwrites the
    model's own results."""
    suffix = f"_{scaling_tag(scaling)}" if scaling is not None else ""
    if weights_dir.parent.name == CHECKPOINTS_DIR:
        return weights_dir.parent.parent / EVAL_DIR / (weights_dir.name + suffix)
    return weights_dir / (EVAL_DIR + suffix)


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
# with this tool: the same task configs, the same harness call, the same figures.


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


def evaluate_validation(
    weights_dir: Path,
    *,
    valid_data: list[str] | None = None,
    samples: int = 256,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str = "auto",
    per_position: bool = False,
    rope_scaling: RopeScalingConfig | None = None,
) -> tuple[dict[str, float], PositionLosses | None]:
    """Validation loss and bits per token/byte of the run's validation split (or `valid_data`),
    and with `per_position` the loss at each position of those samples, from the same pass."""
    import torch

    from pretrain.data.dataset import build_datasets
    from pretrain.eval.harness import load_checkpoint

    model, tok, _, config = load_checkpoint(weights_dir, device=device, dtype=dtype)
    if rope_scaling is not None:
        model.set_rope_scaling(rope_scaling)
    data = from_dict(DataConfig, config.get("data"), "data")
    if valid_data:
        # The builder also wants a train split; the given data serves as both.
        data.valid = list(valid_data)
        data.train, data.train_weights = list(valid_data), None
    if not data.valid:
        raise EvalError(
            f"{weights_dir / CONFIG_FILE} has no data.valid; pass --val-data PREFIX_OR_FOLDER"
        )
    train_cfg = config.get("train") or {}
    seq_len = train_cfg.get("seq_len") or model.cfg.max_seq_len
    _, valid = build_datasets(data, seq_len, train_cfg.get("seed", 1234), 1, samples)
    if valid is None or len(valid) == 0:
        raise EvalError(f"the validation split {data.valid} holds no samples of {seq_len} tokens")
    n = min(samples, len(valid))
    items = [valid[i] for i in range(n)]
    unit = "char" if tok.kind == "chars" else "byte"
    ratio = bytes_per_token(tok, [it["input_ids"] for it in items], unit=unit)
    batches = (
        {
            k: torch.stack([it[k] for it in items[i : i + batch_size]])
            for k in items[0]  # tokens, labels and the document inputs training had
        }
        for i in range(0, n, batch_size)
    )
    positions = PositionLosses(seq_len) if per_position else None
    try:
        out = evaluate_loss(
            model,
            batches,
            positions=positions,
            **({"chars_per_token": ratio} if unit == "char" else {"bytes_per_token": ratio}),
        )
    except ValueError as e:  # e.g. a split too small to hold one scored token
        raise EvalError(
            f"validation data {data.valid}: {e}; prepare a larger validation split "
            f"(tools/prepare_data.py --valid-fraction) or pass --val-data"
        ) from None
    out[f"{unit}s_per_token"] = ratio
    out["samples"] = n
    out["seq_len"] = seq_len
    return out, positions


def evaluate_lengths(
    weights_dir: Path,
    *,
    lengths: str,
    stride: int | None = None,
    rope_scaling: str | RopeScalingConfig | None = None,
    valid_data: list[str] | None = None,
    samples: int = 256,
    batch_tokens: int = 16384,
    device: str | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """positions.json's record: loss by position at each of `lengths` on the validation stream.

    Every length scores the same first N targets of the stream, N = samples x the training
    length rounded down to a multiple of the longest length."""
    from pretrain.data.dataset import DataError, read_token_stream
    from pretrain.eval.harness import load_checkpoint
    from pretrain.eval.positions import (
        common_targets,
        evaluate_length,
        positions_record,
    )

    model, tok, _, config = load_checkpoint(weights_dir, device=device, dtype=dtype)
    documents = DocumentSwitches.of(
        from_dict(DataConfig, config.get("data"), "data"), tok.eod_id, f"{weights_dir}'s tokenizer"
    )
    train_len = train_length(config, model.cfg.max_seq_len)
    sizes = parse_lengths(lengths, train_len)
    check_lengths(model, sizes)
    if stride is not None:
        if stride < 1:
            raise LengthError(f"--stride {stride} must be a positive number of tokens")
        if stride > min(sizes):
            raise LengthError(
                f"--stride {stride} is longer than the shortest window ({min(sizes)} tokens); "
                f"use a stride of at most {min(sizes)}"
            )
    scaling = rope_scaling
    if isinstance(scaling, str):
        scaling = parse_rope_scaling(scaling)
    if scaling is not None:
        try:
            model.set_rope_scaling(scaling)
        except ConfigError as e:
            raise LengthError(f"--rope-scaling: {e}") from None
    entries = valid_entries(config, valid_data, weights_dir)
    budget = samples * train_len
    try:
        stream = read_token_stream(entries, budget + 1)
        n_targets = common_targets(len(stream), sizes, budget)
    except DataError:  # a ValueError too, but its own message already names file and fix
        raise
    except ValueError as e:
        raise LengthError(str(e)) from None
    results: list[LengthResult] = []
    for L in sizes:
        log.info("length %d: %d targets, stride %s", L, n_targets, stride or L)
        results.append(
            evaluate_length(
                model,
                stream,
                L,
                stride,
                n_targets,
                batch_tokens=batch_tokens,
                progress=True,
                documents=documents,
            )
        )
    return positions_record(
        results,
        label="",
        train_seq_len=train_len,
        rope_scaling=to_dict(model.cfg.rope_scaling),
        source="validation stream",
    )


def valid_table(valid: dict[str, float]) -> str:
    cols = [
        ("loss", "loss"),
        ("ppl", "ppl"),
        ("bits/token", "bits_per_token"),
        ("bits/byte", "bits_per_byte"),
        ("bits/char", "bits_per_char"),
        ("tokens", "tokens"),
    ]
    cols = [(t, k) for t, k in cols if k in valid]
    row = [f"{valid[k]:.0f}" if k == "tokens" else fmt(valid[k]) for _, k in cols]
    return markdown_table([t for t, _ in cols], [row])


def write_report(outcome: EvalOutcome, *, label: str, tasks: list[str], limit, data_dir) -> None:
    """results.md: provenance, then the tables."""
    from lm_eval.utils import handle_non_serializable

    out = outcome.output_dir
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Evaluation of {label}",
        "",
        f"- weights: `{outcome.weights_dir}`",
        f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
    ]
    if outcome.results is not None:
        import lm_eval

        path = out / RESULTS_JSON
        atomic_write(
            path,
            json.dumps(
                outcome.results, indent=2, default=handle_non_serializable, ensure_ascii=False
            )
            + "\n",
        )
        outcome.files.append(path)
        lines += [
            f"- lm-eval-harness {lm_eval.__version__}, tasks: {', '.join(tasks)}",
            f"- task data: {'local files in ' + str(data_dir) if data_dir else 'Hugging Face hub'}",
        ]
        reasons: dict[str, list[str]] = {}
        for task, why in outcome.skipped.items():
            reasons.setdefault(why, []).append(task)
        for why, names in reasons.items():
            lines.append(f"- skipped ({why}): {', '.join(names)}")
        cut, scored = outcome.truncated
        if cut:
            lines.append(
                f"- {cut} of {scored} loglikelihood requests were longer than the model's "
                f"context: their contexts were cut on the left, as lm-eval's hf backend does"
            )
        if limit:
            lines.append(
                f"- **--limit {limit}: a subset of each task; not comparable with published numbers**"
            )
        lines += [
            "",
            "Accuracy: acc_norm (length-normalized) for ARC, LogiQA, PIQA, SciQ; acc for "
            "the others. value (stderr).",
            "",
            paper_tables(outcome.results, label),
        ]
    if outcome.valid is not None:
        path = out / VALID_JSON
        atomic_write(path, json.dumps(outcome.valid, indent=2) + "\n")
        outcome.files.append(path)
        lines += ["", "## Validation", "", valid_table(outcome.valid)]
    if outcome.positions is not None:
        rec = outcome.positions
        outcome.files += write_positions(rec, out)
        scaling = rec.get("rope_scaling")
        lines += [
            "",
            "## Loss by position",
            "",
            f"Windows from the {rec['source']}; training length {rec['train_seq_len']}; RoPE "
            f"scaling: {scaling['type'] + ' x' + format(scaling['factor'], 'g') if scaling else 'none'}. "
            f"Per bucket: {POSITIONS_CSV}; curve: {POSITIONS_PNG}.",
            "",
            positions_table(rec),
        ]
    path = out / RESULTS_MD
    atomic_write(path, "\n".join(lines) + "\n")
    outcome.files.append(path)


def evaluate(
    run: str | Path,
    *,
    step: int | None = None,
    tasks: str = "paper",
    limit: int | float | None = None,
    data_dir: str | Path | None = None,
    output: str | Path | None = None,
    batch_size: int = 64,
    device: str | None = None,
    dtype: str = "auto",
    num_fewshot: int | None = None,
    skip_missing: bool = False,
    val: bool = False,
    val_data: list[str] | None = None,
    val_samples: int = 256,
    max_length: int | None = None,
    bootstrap_iters: int | None = None,
    per_position: bool = False,
    lengths: str | None = None,
    stride: int | None = None,
    rope_scaling: str | None = None,
) -> EvalOutcome:
    """Evaluate one checkpoint; see tools/evaluate.py for the meaning of each argument."""
    try:
        wdir = find_weights_dir(run, step)
    except WeightsError as e:
        raise EvalError(str(e)) from None
    task_list = [] if tasks.strip().lower() in ("", "none") else resolve_tasks(tasks)
    if not task_list and not val and not lengths:
        raise EvalError("nothing to do: --tasks none without --val or --lengths")
    if per_position and not (val or lengths):
        raise EvalError("--per-position needs --val (the validation samples) or --lengths")
    if stride is not None and not lengths:
        raise EvalError("--stride needs --lengths (it slides windows of those lengths)")
    scaling = parse_rope_scaling(rope_scaling)
    outcome = EvalOutcome(
        output_dir=Path(output) if output else default_output_dir(wdir, scaling),
        weights_dir=wdir,
    )
    if task_list:
        model_args = {
            "path": str(wdir),
            "batch_size": batch_size,
            "dtype": dtype,
            **({"device": device} if device else {}),
            **({"max_length": max_length} if max_length else {}),
            **({"rope_scaling": scaling} if scaling else {}),
        }
        outcome.results, outcome.skipped, outcome.truncated = run_harness(
            model_args,
            task_list,
            data_dir=data_dir,
            limit=limit,
            num_fewshot=num_fewshot,
            skip_missing=skip_missing,
            bootstrap_iters=bootstrap_iters,
        )
    label = (
        wdir.parent.parent.name + "@" + wdir.name
        if wdir.parent.name == CHECKPOINTS_DIR
        else wdir.name
    )
    if val:
        outcome.valid, positions = evaluate_validation(
            wdir,
            valid_data=val_data,
            samples=val_samples,
            batch_size=min(batch_size, 16),
            device=device,
            dtype=dtype,
            per_position=per_position and not lengths,
            rope_scaling=scaling,
        )
        if positions is not None:
            outcome.positions = positions_record(
                [LengthResult.of(positions, positions.length, int(outcome.valid["samples"]))],
                label=label,
                train_seq_len=int(outcome.valid["seq_len"]),
                rope_scaling=to_dict(scaling),
                source="validation samples",
            )
    if lengths:
        outcome.positions = evaluate_lengths(
            wdir,
            lengths=lengths,
            stride=stride,
            rope_scaling=scaling,
            valid_data=val_data,
            samples=val_samples,
            device=device,
            dtype=dtype,
        )
        outcome.positions["label"] = label
    evaluated = [t for t in task_list if t not in outcome.skipped]
    write_report(outcome, label=label, tasks=evaluated, limit=limit, data_dir=data_dir)
    return outcome


__all__ = [
    "EvalError",
    "choose_examples",
    "downstream_scalars",
    "harness_on",
    "local_tasks",
    "sample_loglikelihoods",
    "EvalOutcome",
    "default_output_dir",
    "evaluate",
    "evaluate_lengths",
    "evaluate_validation",
    "run_harness",
    "write_report",
]
