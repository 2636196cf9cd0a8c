"""Local task data for offline machines: the original files -> the rows the harness sees.

The harness's built-in tasks read their data from the Hugging Face hub. On a machine
without it, `--data-dir DIR` points at local copies; this module finds each task's file
in DIR, converts the ones whose original format is not JSON lines (LogiQA's text files,
WSC's XML, PubMedQA's JSON, LAMBADA's plain text) into exactly the rows of the hub dataset
the built-in task loads, and writes `<task>.jsonl` into a prepared folder that the task
YAMLs beside this file read.

Each converter follows the dataset's own loading script field by field:
    logiqa      EleutherAI/logiqa (lgw863/LogiQA-dataset Test.txt), split test
    wsc273      winograd_wsc/wsc273 (Ernest Davis's WSCollection.xml, first 273), split test
    pubmedqa    bigbio/pubmed_qa pubmed_qa_labeled_fold0_source, split test (the 500 PMIDs
                of test_ground_truth.json, taken from ori_pqal.json)
    lambada_standard  cimec/lambada (lambada_test_plain_text.txt, one passage per line)

Usage (writes every task's <task>.jsonl, for `lm_eval --include_path`):
    python tools/prepare_tasks.py --data-dir ../shared/data/evals --output DIR [--skip-missing]
"""

from __future__ import annotations

import ast
import json
import logging
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import UserError
from pretrain.run_layout import atomic_write

log = logging.getLogger(__name__)


class EvalDataError(UserError, FileNotFoundError):
    """A task's local data file is missing or unreadable; the message names it and the fix."""


# ----------------------------------------------------------------------------- readers


def read_jsonl(paths: Sequence[Path]) -> list[dict[str, Any]]:
    rows = []
    with open(paths[0], encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise EvalDataError(
                        f"{paths[0]}:{n}: not valid JSON ({e.msg}); expected "
                        f"one JSON object per line"
                    ) from None
    return rows


def read_logiqa(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """LogiQA's original text: blank-line separated blocks of 7 lines (answer letter,
    passage, question, options A-D). As the EleutherAI/logiqa loading script: every "."
    becomes ". " (the source lost the space after full stops), options lose their "A."."""

    def normalize(text: str) -> str:
        return text.replace(".", ". ").strip()

    text = Path(paths[0]).read_text(encoding="utf-8")
    rows = []
    for n, block in enumerate(text.strip().split("\n\n")):
        lines = block.split("\n")
        if len(lines) < 7:
            raise EvalDataError(
                f"{paths[0]}: example {n} has {len(lines)} lines, LogiQA "
                f"blocks have 7 (answer, passage, question, 4 options)"
            )
        rows.append(
            {
                "label": lines[0].strip(),
                "context": normalize(lines[1]),
                "question": normalize(lines[2]),
                "options": [normalize(option[2:]) for option in lines[3:]],
            }
        )
    return rows


def read_wsc273(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """WSCollection.xml -> winograd_wsc rows; the first 273 schemas are WSC273."""

    def clean(text: str | None) -> str:
        return " ".join((text or "").split())

    try:
        root = ET.parse(paths[0]).getroot()
    except ET.ParseError as e:
        raise EvalDataError(f"{paths[0]}: not valid XML ({e})") from None
    rows = []
    for schema in list(root)[:273]:
        text, quote = schema.find("text"), schema.find("quote")
        left, right = clean(text.findtext("txt1", "")), clean(text.findtext("txt2", ""))
        q_left, q_right = clean(quote.findtext("quote1", "")), clean(quote.findtext("quote2", ""))
        pronoun = clean(text.findtext("pron"))
        pronoun_loc = len(left) + 1 if left else 0
        rows.append(
            {
                "text": " ".join([left, pronoun, right]).strip(),
                "pronoun": pronoun,
                "pronoun_loc": pronoun_loc,
                "quote": " ".join([q_left, pronoun, q_right]).strip(),
                "quote_loc": pronoun_loc - (len(q_left) + 1 if q_left else 0),
                "options": [clean(a.text) for a in schema.find("answers").findall("answer")],
                # "  A. " or " B " -> 0 / 1
                "label": int("B" in clean(schema.findtext("correctAnswer"))),
                "source": clean(schema.findtext("source")),
            }
        )
    if len(rows) != 273:
        raise EvalDataError(
            f"{paths[0]}: {len(rows)} schemas, WSC273 needs the first 273 of "
            f"the 285 in Ernest Davis's WSCollection.xml"
        )
    return rows


def read_pubmedqa(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """PQA-L (ori_pqal.json) restricted to the official test PMIDs, in their order.

    Fields as bigbio/pubmed_qa's source schema; list fields that the original file holds
    as Python-literal strings are turned into lists."""
    pqal = json.loads(Path(paths[0]).read_text(encoding="utf-8"))
    test = json.loads(Path(paths[1]).read_text(encoding="utf-8"))
    missing = [pmid for pmid in test if pmid not in pqal]
    if missing:
        raise EvalDataError(
            f"{paths[0]} lacks {len(missing)} test PMIDs of {paths[1]} "
            f"(e.g. {missing[0]}); use the PQA-L ori_pqal.json"
        )

    def as_list(v: Any) -> list[str]:
        return ast.literal_eval(v) if isinstance(v, str) else list(v)

    rows = []
    for pmid in test:
        d = pqal[pmid]
        rows.append(
            {
                "QUESTION": d["QUESTION"],
                "CONTEXTS": as_list(d["CONTEXTS"]),
                "LABELS": as_list(d["LABELS"]),
                "MESHES": as_list(d.get("MESHES", [])),
                "YEAR": d.get("YEAR"),
                "reasoning_required_pred": d.get("reasoning_required_pred"),
                "reasoning_free_pred": d.get("reasoning_free_pred"),
                "final_decision": d["final_decision"],
                "LONG_ANSWER": d.get("LONG_ANSWER"),
                "pubid": pmid,
            }
        )
    return rows


def read_lambada_plain(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The original LAMBADA test file: one passage per line (cimec/lambada)."""
    lines = Path(paths[0]).read_text(encoding="utf-8").splitlines()
    return [{"text": line, "domain": None} for line in lines]


# ----------------------------------------------------------------------------- where each task's data is


@dataclass(frozen=True)
class Source:
    files: tuple[str, ...]  # under the data dir, all needed
    split: str  # the split of the original dataset these files hold
    reader: Callable[[Sequence[Path]], list[dict[str, Any]]]


@dataclass(frozen=True)
class TaskData:
    task: str
    split: str  # the split the built-in task scores
    sources: tuple[Source, ...]  # alternatives, first found wins
    hint: str  # where to get the file


def _jsonl(name: str, split: str) -> Source:
    return Source((name,), split, read_jsonl)


TASK_DATA: dict[str, TaskData] = {
    t.task: t
    for t in [
        TaskData(
            "arc_challenge",
            "test",
            (
                _jsonl("arc_challenge_test.jsonl", "test"),
                _jsonl("arc_challenge_validation.jsonl", "validation"),
            ),
            "allenai/ai2_arc ARC-Challenge as JSON lines",
        ),
        TaskData(
            "arc_easy",
            "test",
            (
                _jsonl("arc_easy_test.jsonl", "test"),
                _jsonl("arc_easy_validation.jsonl", "validation"),
            ),
            "allenai/ai2_arc ARC-Easy as JSON lines",
        ),
        TaskData(
            "logiqa",
            "test",
            (Source(("logiqa_Test.txt",), "test", read_logiqa),),
            "Test.txt of github.com/lgw863/LogiQA-dataset",
        ),
        TaskData(
            "lambada_openai",
            "test",
            (_jsonl("lambada_openai_test.jsonl", "test"), _jsonl("lambada_test.jsonl", "test")),
            "OpenAI's lambada_test.jsonl (EleutherAI/lambada_openai, config default)",
        ),
        TaskData(
            "lambada_standard",
            "test",
            (
                _jsonl("lambada_standard_test.jsonl", "test"),
                Source(("lambada_test_plain_text.txt",), "test", read_lambada_plain),
            ),
            "lambada_test_plain_text.txt of the original LAMBADA release "
            "(zenodo.org/record/2630551, lambada-dataset.tar.gz), or cimec/lambada's test split "
            "as JSON lines",
        ),
        TaskData(
            "piqa",
            "validation",
            (_jsonl("piqa_validation.jsonl", "validation"),),
            "PIQA's validation split as JSON lines (goal, sol1, sol2, label)",
        ),
        TaskData(
            "sciq",
            "test",
            (_jsonl("sciq_test.jsonl", "test"), _jsonl("sciq_validation.jsonl", "validation")),
            "allenai/sciq as JSON lines",
        ),
        TaskData(
            "pubmedqa",
            "test",
            (
                Source(
                    ("pubmedqa_ori_pqal.json", "pubmedqa_test_ground_truth.json"),
                    "test",
                    read_pubmedqa,
                ),
            ),
            "data/ori_pqal.json and data/test_ground_truth.json of github.com/pubmedqa/pubmedqa",
        ),
        TaskData(
            "winogrande",
            "validation",
            (_jsonl("winogrande_xl_validation.jsonl", "validation"),),
            "allenai/winogrande winogrande_xl validation split as JSON lines",
        ),
        TaskData(
            "wsc273",
            "test",
            (Source(("wsc_WSCollection.xml",), "test", read_wsc273),),
            "WSCollection.xml of Ernest Davis's Winograd Schema Collection",
        ),
    ]
}


def find_source(task: str, data_dir: str | Path) -> Source:
    """The first source of `task` present in data_dir; a prepared `<task>.jsonl` wins."""
    data_dir = Path(data_dir)
    if task not in TASK_DATA:
        raise EvalDataError(
            f"no local data recipe for task {task!r}; tasks with one: {', '.join(TASK_DATA)}"
        )
    spec = TASK_DATA[task]
    sources = (_jsonl(f"{task}.jsonl", spec.split),) + spec.sources
    for source in sources:
        if all((data_dir / f).is_file() for f in source.files):
            return source
    wanted = " or ".join("+".join(s.files) for s in sources)
    raise EvalDataError(
        f"task {task}: no data file in {data_dir}: looked for {wanted}; get "
        f"{spec.hint} and put it there (see docs/evaluation.md)"
    )


def load_rows(task: str, data_dir: str | Path) -> tuple[list[dict[str, Any]], Source]:
    source = find_source(task, data_dir)
    rows = source.reader([Path(data_dir) / f for f in source.files])
    if not rows:
        raise EvalDataError(f"task {task}: {Path(data_dir) / source.files[0]} holds no rows")
    return rows, source


def _write_if_changed(path: Path, data: bytes) -> None:
    # Unchanged files keep their mtime, so the datasets library reuses its cache of them.
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return
    atomic_write(path, data, fsync=False)


def prepare_task_data(
    tasks: Sequence[str], data_dir: str | Path, output_dir: str | Path
) -> dict[str, tuple[Path, Source]]:
    """Write `<task>.jsonl` for each task into output_dir. Returns task -> (file, source).

    Every task's file is checked before anything is written, so a missing file is reported
    before minutes of evaluation, not after."""
    data_dir, output_dir = Path(data_dir), Path(output_dir)
    if not data_dir.is_dir():
        raise EvalDataError(f"--data-dir {data_dir} is not a folder")
    for task in tasks:
        find_source(task, data_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for task in tasks:
        rows, source = load_rows(task, data_dir)
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        path = output_dir / f"{task}.jsonl"
        _write_if_changed(path, data)
        if source.split != TASK_DATA[task].split:
            log.warning(
                "%s: scoring the %s split (%s); the harness scores %s, so numbers are "
                "not comparable with published ones",
                task,
                source.split,
                source.files[0],
                TASK_DATA[task].split,
            )
        out[task] = (path, source)
    return out
