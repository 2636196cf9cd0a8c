"""Evaluate a checkpoint: the harness's task suite and/or validation loss, written to the run.

Outputs go to RUN/eval/<step tag>/ (or `output`):
    lm_eval_results.json   the harness's results JSON, unchanged
    valid_metrics.json     validation loss, perplexity, bits per token/byte (with --val)
    positions.json/.csv/.png  loss by position (--val --per-position) and at each length
                           (--lengths), with the curve
    results.md             the paper's accuracy table, the LAMBADA perplexity table,
                           and the validation figures

`evaluate` runs what tools/evaluate.py asks: the tasks through pretrain/eval/suite.py, the
validation figures through pretrain/eval/validation.py; `write_report` writes the files.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.config import RopeScalingConfig, to_dict
from pretrain.eval.lengths import parse_rope_scaling, scaling_tag
from pretrain.eval.positions import (
    POSITIONS_CSV,
    POSITIONS_PNG,
    LengthResult,
    positions_record,
    positions_table,
    write_positions,
)
from pretrain.eval.suite import EvalError, run_harness
from pretrain.eval.tables import fmt, markdown_table, paper_tables
from pretrain.eval.tasks import resolve_tasks
from pretrain.eval.validation import evaluate_lengths, evaluate_validation
from pretrain.run_layout import CHECKPOINTS_DIR, EVAL_DIR, atomic_write
from pretrain.weights import WeightsError, find_weights_dir

RESULTS_JSON = "lm_eval_results.json"
VALID_JSON = "valid_metrics.json"
RESULTS_MD = "results.md"


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
