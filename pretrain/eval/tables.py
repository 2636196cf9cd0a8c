"""Results tables in the paper's layout, from the harness's results JSON.

Accuracy is the harness's length-normalized `acc_norm` where the task reports it, plain
`acc` for LAMBADA, PubMedQA, WinoGrande and WSC, each as `value (stderr)`. LAMBADA's
perplexities go in a second table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pretrain.tables import pipe_table

# (column title, task, metric) in the paper's order
PAPER_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("ARC-C", "arc_challenge", "acc_norm"),
    ("ARC-E", "arc_easy", "acc_norm"),
    ("LogiQA", "logiqa", "acc_norm"),
    ("LAMBADA OpenAI", "lambada_openai", "acc"),
    ("LAMBADA standard", "lambada_standard", "acc"),
    ("PIQA", "piqa", "acc_norm"),
    ("SciQ", "sciq", "acc_norm"),
    ("PubMedQA", "pubmedqa", "acc"),
    ("WinoGrande", "winogrande", "acc"),
    ("WSC", "wsc273", "acc"),
)
PPL_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("LAMBADA OpenAI ppl", "lambada_openai", "perplexity"),
    ("LAMBADA standard ppl", "lambada_standard", "perplexity"),
)
MISSING = "–"


def metric(
    results: Mapping[str, Any], task: str, name: str, filt: str = "none"
) -> tuple[float, float] | None:
    """(value, stderr) of `name` for `task` from a harness results dict, or None."""
    r = results.get("results", results).get(task)
    if not r or f"{name},{filt}" not in r:
        return None
    value = r[f"{name},{filt}"]
    stderr = r.get(f"{name}_stderr,{filt}")
    try:
        stderr = float(stderr)
    except (TypeError, ValueError):  # the harness writes "N/A" when it has none
        stderr = float("nan")
    return float(value), stderr


def fmt(value: float | None, stderr: float | None = None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    text = f"{value:.{digits}f}"
    if stderr is not None and not math.isnan(stderr):
        text += f" ({stderr:.{digits}f})"
    return text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A pipe table (pretrain/tables.py) as a block of a markdown report: it ends with a
    newline, so the reports put a blank line after it."""
    return pipe_table(header, rows) + "\n"


def _row(results: Mapping[str, Any], columns) -> list[str]:
    out = []
    for _, task, name in columns:
        m = metric(results, task, name)
        out.append(fmt(*m) if m else MISSING)
    return out


def paper_tables(results: Mapping[str, Any], label: str = "model") -> str:
    """The accuracy table and the LAMBADA perplexity table, as markdown."""
    acc = markdown_table(
        ["model"] + [c[0] for c in PAPER_COLUMNS], [[label] + _row(results, PAPER_COLUMNS)]
    )
    ppl = markdown_table(
        ["model"] + [c[0] for c in PPL_COLUMNS], [[label] + _row(results, PPL_COLUMNS)]
    )
    return acc + "\n" + ppl
