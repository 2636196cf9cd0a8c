"""`study plan`'s cache (pretrain/study/plan.py): a second plan reads every run's trace from
studies/NAME/plan_cache/ and calls no planner; a changed run, a changed GPU and a corrupt
entry are traced again, and `--fresh` traces everything."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from pretrain.study import load_study
from pretrain.study.plan import PLAN_CACHE_DIR, plan_rows

REPO = Path(__file__).resolve().parents[1]

# The char GPT (the smallest model config: about 1 s a trace on 2 cores), two micro batches
# of two seeds each: four runs, two traces.
STUDY = """
description: micro batches of a small model
config:
  inherit: {model: configs/models/gpt_char.yaml}
  model: {vocab_size: 65}
  data: {train: [data/a], valid: [data/a]}
  train: {train_iters: 100, global_batch_size: 16, seq_len: 128}
  logging: {run_dir: layout}
axes:
  micro: {key: train.micro_batch_size, values: [4, 8]}
run_name: "small_micro{micro}"
seeds: [1, 2]
layout: {config: "configs/small/{stem}.yaml", script: "slurm/small/{name}.sh", run_dir: "runs/small/{name}"}
"""
NAMES = [f"small_micro{m}_s{s}" for m in (4, 8) for s in (1, 2)]


@pytest.fixture
def repo(tmp_path) -> Path:
    shutil.copytree(REPO / "configs" / "models", tmp_path / "configs" / "models")
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "small.yaml").write_text(STUDY)
    return tmp_path


def plan(repo: Path, *args, **kwargs) -> tuple[list[dict], str]:
    """plan_rows of studies/small.yaml (loaded afresh) on an H100, and what it logged."""
    log = io.StringIO()
    rows = plan_rows(load_study(repo / "studies" / "small.yaml"), "h100", *args, log=log, **kwargs)
    return rows, log.getvalue()


def entries(repo: Path) -> list[Path]:
    return sorted((repo / "studies" / "small" / PLAN_CACHE_DIR).glob("*.json"))


def no_planner(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the planner was called")

    monkeypatch.setattr("pretrain.planner.search.plan_run", refuse)  # plan_rows imports it per call


def traced(log: str) -> list[str]:
    return [line.split()[1] for line in log.splitlines() if line.startswith("planned ")]


def test_a_second_plan_reads_the_cache(repo, monkeypatch):
    rows, log = plan(repo)
    assert [r["name"] for r in rows] == NAMES
    assert traced(log) == ["small_micro4_s1", "small_micro8_s1"]  # seeds share a trace
    assert "plan cache" not in log
    assert len(entries(repo)) == 2
    assert [r["micro_batch"] for r in rows] == [4, 4, 8, 8]

    no_planner(monkeypatch)
    again, log = plan(repo)
    assert again == rows
    assert traced(log) == [] and "4 of 4 runs from the plan cache" in log
    # The cache keeps what the time needs at any MFU, not one MFU's hours.
    half, _ = plan(repo, mfu=0.2)
    for r, h in zip(rows, half, strict=True):
        assert h["wall_hours"] == pytest.approx(2 * r["wall_hours"])
        assert h["peak_gib"] == r["peak_gib"] and h["fits"] == r["fits"]
    # Another GPU is another key; fresh (--fresh) and cache=False read no entry.
    with pytest.raises(AssertionError, match="planner was called"):
        plan_rows(load_study(repo / "studies" / "small.yaml"), "h200")
    for off in ({"fresh": True}, {"cache": False}):
        with pytest.raises(AssertionError, match="planner was called"):
            plan(repo, **off)


def test_only_a_changed_run_is_traced_again(repo):
    rows, _ = plan(repo)
    study = repo / "studies" / "small.yaml"
    study.write_text(STUDY.replace("values: [4, 8]", "values: [4, 16]"))
    changed, log = plan(repo)
    assert traced(log) == ["small_micro16_s1"]
    assert "2 of 4 runs from the plan cache" in log
    assert changed[:2] == rows[:2]  # micro 4: from the cache, as before
    assert [r["micro_batch"] for r in changed[2:]] == [16, 16]
    assert changed[2]["peak_gib"] > rows[2]["peak_gib"]
    assert len(entries(repo)) == 3  # the micro 8 entry stays for when it comes back


def test_a_corrupt_entry_is_a_miss(repo):
    rows, _ = plan(repo)
    broken, wrong = entries(repo)
    broken.write_text('{"figures": {"n_params"')  # cut short
    data = json.loads(wrong.read_text())
    data["figures"]["peak"] = "2 GiB"  # not bytes
    wrong.write_text(json.dumps(data))
    again, log = plan(repo)
    assert again == rows
    assert len(traced(log)) == 2 and "plan cache" not in log
    for path in entries(repo):  # rewritten whole
        assert isinstance(json.loads(path.read_text())["figures"]["peak"], int)


def test_fresh_through_the_program(repo, monkeypatch, capsys):
    from pretrain.cli import study as cli
    from pretrain.study import plan

    seen = {}

    def fake_plan_rows(study, gpu, mfu, log=None, **kwargs):
        seen.update(kwargs)
        return []

    monkeypatch.setattr(plan, "plan_rows", fake_plan_rows)  # the program calls plan.plan_rows
    monkeypatch.chdir(repo)
    assert cli.main(["plan", "studies/small.yaml", "--fresh"]) == 0
    assert seen == {"fresh": True}
    assert cli.main(["plan", "studies/small.yaml"]) == 0
    assert seen == {"fresh": False}


def test_the_key_holds_the_sources_a_trace_loads_and_no_other():
    """A real trace, in a process of its own, loads no module of ours outside trace_sources:
    the key holds every source the plan depends on. The trainer, the study's own modules
    and the programs are not among them: an edit there retraces nothing."""
    import subprocess
    import sys

    from pretrain.study.plan import trace_sources

    code = """
import json, sys
from pretrain.config import Config, from_dict, load_config
from pretrain.planner.gpus import parse_gpu
from pretrain.planner.search import plan_run
cfg = load_config("configs/char/shakespeare_theta10000.yaml")
plan_run(cfg, parse_gpu("h100"), 1)
print(json.dumps([m.__file__ for n, m in sys.modules.items()
                  if n.startswith("pretrain") and getattr(m, "__file__", None)]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = {Path(f).resolve() for f in json.loads(out.stdout.splitlines()[-1])}
    sources = {p.resolve() for p in trace_sources()}
    assert len(loaded) > 20 and loaded <= sources, sorted(map(str, loaded - sources))
    names = {p.relative_to(REPO / "pretrain").as_posix() for p in sources}
    assert {"planner/search.py", "model/attention.py", "train/engine.py"} <= names
    outside = {"train/trainer.py", "train/metrics.py", "study/plan.py", "cli/study.py"}
    assert not names & outside


def test_traces_in_processes_of_their_own_equal_traces_here(repo, monkeypatch):
    """Traced in a pool of processes (as a cold plan of many shapes is) or in this process,
    every row is the same."""
    from pretrain.study import plan as study_plan

    monkeypatch.setattr(study_plan, "PARALLEL_FROM", 10**6)
    here, _ = plan(repo, cache=False)
    monkeypatch.setattr(study_plan, "PARALLEL_FROM", 2)  # the study's two shapes, in a pool
    pooled, log = plan(repo, cache=False)
    assert log.count("planned ") == 2
    assert pooled == here
