"""`tools/study.py plan` and `write` (pretrain/study/plan.py, write.py): the planner's
figures per run and in total; configs and job scripts written once, the second time nothing."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.analysis.model_info import model_info
from pretrain.config import load_config
from pretrain.study import load_study
from pretrain.study.plan import format_plan_table, plan_rows

REPO = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(REPO / "tools" / "study.py")]

STUDY = """
description: a small theta study
config:
  inherit: {model: configs/models/gpt_char.yaml}
  model: {vocab_size: 65}
  data: {train: [data/a], valid: [data/a]}
  train: {train_iters: 100, global_batch_size: 16, micro_batch_size: 8, seq_len: 128}
  logging: {run_dir: layout}
axes:
  theta: {key: model.rope_theta, values: [500, 10000]}
run_name: "small_theta{theta}"
seeds: [1, 2]
layout: {config: "configs/small/{stem}.yaml", script: "slurm/small/{name}.sh", run_dir: "runs/small/{name}"}
slurm: {nodes: 1, gpus_per_node: 2, cpus_per_task: 4, exclusive: false, mem: 16G,
        time: "1:00:00", signal_margin_s: 60}
"""


@pytest.fixture
def repo(tmp_path) -> Path:
    shutil.copytree(REPO / "configs" / "models", tmp_path / "configs" / "models")
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "small.yaml").write_text(STUDY)
    return tmp_path


def tool(repo: Path, *args: str, launch: bool = False) -> subprocess.CompletedProcess:
    """The program in `repo`: launched as `tools/study.py` (once, for the launcher), else its
    main() in this process (the same code after the imports, a second or two less a call)."""
    if launch:
        return subprocess.run(
            [*TOOL, *args], cwd=repo, capture_output=True, text=True, timeout=300, check=False
        )
    from pretrain.cli.study import main

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(repo)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_plan_through_the_program(repo):
    out = tool(repo, "plan", "studies/small.yaml", "--gpu", "h100", launch=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "on H100 SXM 80GB (79.7 GiB per GPU)"
    assert lines[1].split() == [
        "run",
        "params",
        "tokens",
        "steps",
        "nodes",
        "x",
        "GPUs",
        "micro",
        "x",
        "accum",
        "peak/GPU",
        "fits?",
        "GPU-hours",
        "wall",
        "time",
    ]
    names = [line.split()[0] for line in lines[2:-1]]
    assert names == [f"small_theta{t}_s{s}" for t in (500, 10000) for s in (1, 2)]
    params = model_info(load_config(REPO / "configs" / "char" / "shakespeare_theta500.yaml").model)
    row = lines[2].split()
    # 100 steps of 16 x 128 tokens, on 1 node x 2 GPUs: micro 8 x accumulation 1.
    assert row[1:10] == [f"{params.params / 1e6:.3g}M", "205k", "100", "1", "x", "2", "8", "x", "1"]
    assert row[12] == "yes"
    assert lines[-1].split()[:6] == ["total:", "4", "runs", "819k", "400", "max"]
    assert lines[-1].split()[8] == "all"
    # The seeds of a group are traced once: two traces for four runs.
    assert out.stderr.count("planned ") == 2, out.stderr


def test_plan_rows_add_up(repo):
    study = load_study(repo / "studies" / "small.yaml")
    rows = plan_rows(study, "h200")
    assert [r["name"] for r in rows] == [r.name for r in study.runs]
    for r in rows:
        assert r["tokens"] == 100 * 16 * 128 and r["steps"] == 100 and r["gpus"] == 2
        assert r["fits"] and 0 < r["peak_gib"] < 5
        assert r["gpu_hours"] == pytest.approx(2 * r["wall_hours"])
        assert r["slurm_time"] == "1:00:00"
    # Theta changes no shape: the same memory and time for every run.
    assert len({(r["peak_gib"], r["wall_hours"]) for r in rows}) == 1
    table = format_plan_table(rows)
    assert table.splitlines()[0] == "on H200 141GB (140.4 GiB per GPU)"


def test_plan_says_what_does_not_fit(repo):
    text = STUDY.replace(
        "global_batch_size: 16, micro_batch_size: 8",
        "global_batch_size: 16384, micro_batch_size: 8192",
    )
    (repo / "studies" / "big.yaml").write_text(
        text.replace("values: [500, 10000]", "values: [500]")
    )
    out = tool(repo, "plan", "studies/big.yaml", "--gpu", "h100")
    assert out.returncode == 1, out.stderr
    row = out.stdout.splitlines()[2].split()
    assert row[0] == "small_theta500_s1" and row[12] == "NO" and float(row[10]) > 79.7
    assert out.stdout.splitlines()[-1].split()[8:11] == ["2", "do", "not"]  # both seeds


def test_write_twice_through_the_program(repo):
    out = tool(repo, "write", "studies/small.yaml")
    assert out.returncode == 0, out.stderr
    configs = [f"configs/small/small_theta{t}.yaml" for t in (500, 10000)]
    scripts = [f"slurm/small/small_theta{t}_s{s}.sh" for t in (500, 10000) for s in (1, 2)]
    assert out.stdout.splitlines() == [
        *[f"wrote {p}" for p in [configs[0], scripts[0], scripts[1], configs[1], *scripts[2:]]],
        "small: 4 runs, 6 files; 6 changed",
    ]
    out = tool(repo, "write", "studies/small.yaml")
    assert out.returncode == 0 and out.stdout == "small: 4 runs, 6 files; nothing changed\n"

    # What was written is what the study means: each run's config as the trainer loads it.
    study = load_study(repo / "studies" / "small.yaml")
    for run in study.runs:
        cfg = load_config(repo / run.config_path, list(run.overrides))
        assert (cfg.train.seed, cfg.logging.run_dir) == (run.seed, run.run_dir)
        assert cfg.model.rope_theta == float(run.labels["theta"])
        script = (repo / run.script_path).read_text()
        assert f"#SBATCH --job-name={run.name}\n" in script
        assert script.endswith(
            f"exec slurm/launch.sh {run.config_path} --set train.seed={run.seed} "
            f'--set logging.run_dir={run.run_dir} "$@"\n'
        )
        assert subprocess.run(["bash", "-n", str(repo / run.script_path)]).returncode == 0
    head = (repo / configs[0]).read_text().splitlines()[:2]
    assert head == [
        "# small_theta500: a small theta study.",
        "# Generated by `python tools/study.py write studies/small.yaml`: edit the study, not "
        "this file.",
    ]

    # A hand edit is undone, and only that file is listed.
    (repo / scripts[3]).write_text("#!/bin/bash\n")
    out = tool(repo, "write", "studies/small.yaml")
    assert out.stdout.splitlines()[0] == f"wrote {scripts[3]}"

    # One job array instead, at most 3 runs at once.
    out = tool(repo, "write", "studies/small.yaml", "--array", "--max-running", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "wrote studies/small/slurm/small.sh",
        "small: 4 runs, 3 files; 1 changed",
    ]
    array = (repo / "studies" / "small" / "slurm" / "small.sh").read_text()
    assert (
        "#SBATCH --array=0-3%3\n" in array and "#SBATCH --output=slurm/logs/%x-%A_%a.out\n" in array
    )
    assert (
        "  3) set -- configs/small/small_theta10000.yaml --set train.seed=2 "
        '--set logging.run_dir=runs/small/small_theta10000_s2 "$@" ;;  # small_theta10000_s2\n'
    ) in array
    assert (
        subprocess.run(["bash", "-n", str(repo / "studies/small/slurm/small.sh")]).returncode == 0
    )
    out = tool(repo, "write", "studies/small.yaml", "--array", "--max-running", "3")
    assert out.stdout == "small: 4 runs, 3 files; nothing changed\n"
