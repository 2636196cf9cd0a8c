"""Offline task configs and converters against the installed harness's built-in tasks.

The built-in task config of each task is loaded from the installed lm_eval and fed the same
local rows as our offline twin; prompts, choices, targets and the requests the harness
builds must be equal. That is what makes offline scores comparable with published ones.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
from pathlib import Path

import pytest
from conftest import shared_path

from pretrain.eval.tasks import PAPER_SUITE, load_local_config, local_task_configs, resolve_tasks
from pretrain.eval.tasks.convert import (
    EvalDataError,
    find_source,
    prepare_task_data,
    read_logiqa,
    read_pubmedqa,
    read_wsc273,
)

N_DOCS = 60  # rendering the harness's templates costs ~1 ms per document and call


@functools.cache
def _builtin_yamls() -> dict[str, list[Path]]:
    """Candidate YAML files of the installed harness for each task of the suite (one scan)."""
    import lm_eval

    found: dict[str, list[Path]] = {}
    for path in (Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml"):
        text = path.read_text(errors="ignore")
        for task in PAPER_SUITE:
            if f"task: {task}\n" in text:
                found.setdefault(task, []).append(path)
    return found


def builtin_config(task: str) -> dict:
    """The installed harness's own YAML config of `task` (functions resolved, includes merged)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in _builtin_yamls().get(task, []):
        cfg = load_yaml(path, resolve_func=True)
        if cfg.get("task") == task:
            return cfg
    raise AssertionError(f"built-in task {task} not found in the installed lm_eval")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Every suite task converted from the real files (lambada_standard has no local copy: its
    prompt is checked on LAMBADA OpenAI's rows, which have the same single `text` field)."""
    data = shared_path("evals")
    tasks = [t for t in PAPER_SUITE if t != "lambada_standard"]
    out = tmp_path_factory.mktemp("prepared")
    configs = {c["task"]: c for c in local_task_configs(tasks, data, out)}
    std = copy.deepcopy(load_local_config("lambada_standard"))
    std["dataset_kwargs"]["data_files"] = {
        "test": configs["lambada_openai"]["dataset_kwargs"]["data_files"]["test"]
    }
    configs["lambada_standard"] = std
    return configs


def _with_local_data(builtin: dict, data_file: str) -> dict:
    """The built-in config, reading `data_file` as the split it scores; nothing else changed
    but the data source (and the unused train/few-shot splits, which have no local file)."""
    cfg = copy.deepcopy(builtin)
    split = cfg.get("test_split") or cfg.get("validation_split")
    cfg.update(
        dataset_path="json",
        dataset_name=None,
        dataset_kwargs={"data_files": {split: data_file}},
        training_split=None,
        fewshot_split=None,
    )
    if cfg.get("test_split"):
        cfg["validation_split"] = None
    for key in ("tag", "group"):
        cfg.pop(key, None)
    return cfg


@pytest.mark.parametrize("task", PAPER_SUITE)
def test_local_task_prompts_equal_builtin(task, prepared):
    from lm_eval.api.task import ConfigurableTask

    ours_cfg = prepared[task]
    data_file = next(iter(ours_cfg["dataset_kwargs"]["data_files"].values()))
    builtin = builtin_config(task)
    ours = ConfigurableTask(config=copy.deepcopy(ours_cfg))
    theirs = ConfigurableTask(config=_with_local_data(builtin, data_file))

    assert ours.OUTPUT_TYPE == theirs.OUTPUT_TYPE == builtin["output_type"]
    assert [m["metric"] for m in ours_cfg["metric_list"]] == [
        m["metric"] for m in builtin["metric_list"]
    ]
    docs_ours = list(itertools.islice(ours.eval_docs, N_DOCS))
    docs_theirs = list(itertools.islice(theirs.eval_docs, N_DOCS))
    assert len(docs_ours) >= N_DOCS
    assert docs_ours == docs_theirs  # process_docs (wsc273) applied alike
    for doc in docs_ours:
        assert ours.doc_to_text(doc) == theirs.doc_to_text(doc)
        assert ours.doc_to_target(doc) == theirs.doc_to_target(doc)
        if ours.OUTPUT_TYPE == "multiple_choice":
            choices = ours.doc_to_choice(doc)
            assert choices == theirs.doc_to_choice(doc)
            assert len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
    # The requests the harness sends to a model: context and continuation strings.
    ours.build_all_requests(limit=N_DOCS, rank=0, world_size=1)
    theirs.build_all_requests(limit=N_DOCS, rank=0, world_size=1)
    assert [i.args for i in ours.instances] == [i.args for i in theirs.instances]
    assert len(ours.instances) >= N_DOCS


def test_wsc273_rows_follow_the_hf_script():
    rows = read_wsc273([shared_path("evals", "wsc_WSCollection.xml")])
    assert len(rows) == 273
    first = rows[0]  # the example of the winograd_wsc dataset card
    assert (
        first["text"]
        == "The city councilmen refused the demonstrators a permit because they feared violence."
    )
    assert (first["pronoun"], first["pronoun_loc"], first["label"]) == ("they", 63, 0)
    assert first["options"] == ["The city councilmen", "the demonstrators"]
    assert rows[1]["label"] == 1  # "advocated violence": the demonstrators
    for r in rows:
        assert r["text"][r["pronoun_loc"] :].startswith(r["pronoun"])
        assert r["label"] in (0, 1) and len(r["options"]) == 2
        assert "  " not in r["text"]


def test_logiqa_rows_follow_the_hf_script():
    path = shared_path("evals", "logiqa_Test.txt")
    rows = read_logiqa([path])
    assert len(rows) == 651
    assert all(r["label"] in "abcd" and len(r["options"]) == 4 for r in rows)
    first = rows[0]
    assert first["label"] == "a"
    # The source lost spaces after full stops; the loader puts them back.
    assert "citizen park. These four communities" in first["context"]
    assert first["options"][0] == "Civic Park is north of the administrative service area"
    assert (
        first["question"] == "Based on the above statement, which of the following can be derived?"
    )


def test_pubmedqa_rows_are_the_official_test_split():
    pqal = shared_path("evals", "pubmedqa_ori_pqal.json")
    truth_path = shared_path("evals", "pubmedqa_test_ground_truth.json")
    rows = read_pubmedqa([pqal, truth_path])
    truth = json.loads(truth_path.read_text())
    assert [r["pubid"] for r in rows] == list(truth)
    assert [r["final_decision"] for r in rows] == list(truth.values())
    assert all(isinstance(r["CONTEXTS"], list) and r["CONTEXTS"] for r in rows)
    assert {r["final_decision"] for r in rows} == {"yes", "no", "maybe"}


def test_missing_file_error_names_it(tmp_path):
    with pytest.raises(EvalDataError, match="logiqa_Test.txt"):
        find_source("logiqa", tmp_path)
    with pytest.raises(EvalDataError, match="pubmedqa_test_ground_truth.json"):
        (tmp_path / "pubmedqa_ori_pqal.json").write_text("{}")
        find_source("pubmedqa", tmp_path)
    with pytest.raises(EvalDataError, match="no local data recipe for task 'hellaswag'"):
        find_source("hellaswag", tmp_path)


def test_prepare_keeps_unchanged_files(tmp_path):
    data = shared_path("evals")
    out = prepare_task_data(["wsc273"], data, tmp_path)
    path = out["wsc273"][0]
    before = path.stat().st_mtime_ns
    os.utime(path, ns=(before - 10**9, before - 10**9))
    prepare_task_data(["wsc273"], data, tmp_path)
    assert (
        path.stat().st_mtime_ns == before - 10**9
    )  # not rewritten: the datasets cache stays valid
    assert sum(1 for _ in path.open()) == 273


def test_resolve_tasks():
    assert resolve_tasks("paper") == list(PAPER_SUITE)
    assert resolve_tasks("piqa,paper") == ["piqa"] + [t for t in PAPER_SUITE if t != "piqa"]
    with pytest.raises(EvalDataError):
        resolve_tasks(" , ")
