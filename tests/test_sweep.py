"""The shipped studies (studies/partial_rope.yaml, char_theta.yaml, nanogpt_rope_enwik8.yaml):
checked-in configs and job scripts equal what the studies write, load with the trainer's
loader, carry the paper's settings, and the shell scripts pass bash -n and shellcheck."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import missing

from pretrain.config import load_config
from pretrain.planner import PAPER_PLAN
from pretrain.study import StudyError, load_study
from pretrain.sweep import (
    GENERATED,
    Run,
    Slurm,
    paper_runs,
    shipped_stale_files,
    time_limit_s,
    with_slurm,
    write_shipped,
)

REPO = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "slurm").glob("*.sh")) + [
    "tools/slurm_local.sh"
]


def plan_rows() -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(PAPER_PLAN.read_text())["runs"]}


def study_checkout(tmp_path: Path) -> Path:
    """A checkout's studies/ and what they read (presets, the paper's plan), nothing written."""
    shutil.copytree(REPO / "studies", tmp_path / "studies")
    shutil.copytree(REPO / "configs" / "models", tmp_path / "configs" / "models")
    (tmp_path / "pretrain").mkdir()
    shutil.copy(PAPER_PLAN, tmp_path / "pretrain" / PAPER_PLAN.name)
    return tmp_path


def test_checked_in_files_equal_the_studies():
    stale = shipped_stale_files(REPO)
    assert not stale, f"run `python tools/sweep.py write`; these differ from their study: {stale}"


def test_drift_is_detected(tmp_path):
    """A hand edit, a missing file and a generated file no study writes are all reported."""
    study_checkout(tmp_path)
    (tmp_path / "slurm").mkdir()
    assert len(write_shipped(tmp_path)) == 50 + 50 + 18 + 1 + 2  # configs, scripts, arrays
    assert shipped_stale_files(tmp_path) == []
    assert write_shipped(tmp_path) == []
    script = tmp_path / "slurm" / "llama1b_rope10.sh"
    script.write_text(script.read_text().replace("--nodes=4", "--nodes=2"))
    (tmp_path / "configs" / "paper" / "llama8b_rope50.yaml").unlink()
    (tmp_path / "configs" / "paper" / "llama1b_rope11.yaml").write_text(f"# {GENERATED}\n")
    (tmp_path / "slurm" / "old_run.sh").write_text(f"# {GENERATED}\n")
    (tmp_path / "slurm" / "handmade.sh").write_text("# not generated\n")
    assert sorted(shipped_stale_files(tmp_path)) == sorted(
        [
            "slurm/llama1b_rope10.sh",
            "configs/paper/llama8b_rope50.yaml",
            "configs/paper/llama1b_rope11.yaml",
            "slurm/old_run.sh",
        ]
    )


def test_grid_has_every_run_of_the_paper():
    """The names, spelled out here from the paper's list of runs (not from the grid)."""
    want = {f"llama1b_rope{p}" for p in (0, 4, 10, 25, 50, 75, 100)}
    want |= {
        f"llama1b_seq{s}_rope{p}" for s in (1024, 4096, 8192) for p in (0, 4, 10, 25, 50, 75, 100)
    }
    want |= {"llama1b_seq8192_rope0_qknorm"}
    want |= {f"llama1b_edu_rope{p}" for p in (0, 4, 10, 25, 50, 75, 100)}
    want |= {f"pythia1b_rope{p}" for p in (0, 1, 10, 25, 50, 75, 100)} | {"pythia1b_rope0_qknorm"}
    want |= {f"llama8b_rope{p}" for p in (0, 10, 25, 50, 75, 100)}
    names = [r.name for r in paper_runs()]
    assert len(names) == len(set(names))
    assert set(names) == want


# Appendix A of the paper, as it gives the three shapes (GPT-NeoX configs): layers, width,
# heads, KV heads, FFN width, theta, norm, block, biases (MLP, attention), tied embeddings.
APPENDIX_A = {
    "llama1b": dict(
        n_layers=16,
        d_model=2048,
        n_heads=32,
        kv_heads=8,
        d_ff=8192,
        rope_theta=10000,
        norm="rmsnorm",
        block="sequential",
        mlp_bias=True,
        attn_bias=False,
        tie_embeddings=False,
    ),
    "pythia1b": dict(
        n_layers=16,
        d_model=2048,
        n_heads=8,
        kv_heads=8,
        d_ff=2816,
        rope_theta=10000,
        norm="rmsnorm",
        block="parallel",
        mlp_bias=True,
        attn_bias=False,
        tie_embeddings=False,
    ),
    "llama8b": dict(
        n_layers=36,
        d_model=4096,
        n_heads=32,
        kv_heads=8,
        d_ff=14336,
        rope_theta=10000,
        norm="rmsnorm",
        block="sequential",
        mlp_bias=True,
        attn_bias=False,
        tie_embeddings=False,
    ),
}
# Rotary dims the paper's runs used: int(head_dim x fraction) (Pythia's 10% run: 26 dims, with a
# fraction of 0.102 in its GPT-NeoX config).
PAPER_ROTARY_DIMS = {
    "llama1b": {0: 0, 4: 2, 10: 6, 25: 16, 50: 32, 75: 48, 100: 64},
    "pythia1b": {0: 0, 1: 2, 10: 26, 25: 64, 50: 128, 75: 192, 100: 256},
    "llama8b": {0: 0, 10: 12, 25: 32, 50: 64, 75: 96, 100: 128},
}
PAPER_TOKENS = 12_000 * 2**23  # Appendix B: 12,000 steps of 2^23 tokens at every length
PAPER_MICRO_BATCH = {1024: 128, 2048: 64, 4096: 32, 8192: 16}  # per GPU, 1B runs


@pytest.mark.parametrize("run", paper_runs(), ids=lambda r: r.name)
def test_config_trains_the_papers_budget_and_shape(run):
    cfg = load_config(REPO / run.config_path)
    m, t = cfg.model, cfg.train
    name = run.name
    family = name.split("_")[0]
    seq = int(re.search(r"_seq(\d+)", name).group(1)) if "_seq" in name else 2048
    percent = int(re.search(r"_rope(\d+)", name).group(1))
    # The budget: tokens per step x steps is the paper's, exactly, at every sequence length.
    assert cfg.seq_len == seq and m.max_seq_len == seq
    assert t.global_batch_size * seq == 2**23
    assert t.global_batch_size * seq * t.train_iters == PAPER_TOKENS
    # The batch layout of the job script that trains it: one rank per task of its header.
    opts = sbatch_options(REPO / run.script_path)
    ranks = int(opts["--nodes"]) * int(opts["--ntasks-per-node"])
    assert ranks == 32 and int(opts["--gpus-per-node"]) == int(opts["--ntasks-per-node"])
    accumulation, rest = divmod(t.global_batch_size, t.micro_batch_size * ranks)
    assert rest == 0 and t.global_batch_size == t.micro_batch_size * accumulation * ranks
    if family == "llama8b":
        assert (t.micro_batch_size, accumulation) == (4, 32)
        assert t.grad_accum_dtype == "bf16"
    else:  # the paper's micro batches, the same accumulation (2) at every length
        assert (t.micro_batch_size, accumulation) == (PAPER_MICRO_BATCH[seq], 2)
        assert t.grad_accum_dtype == "fp32"
    # Appendix A.
    for key, want in APPENDIX_A[family].items():
        assert getattr(m, key) == want, key
    assert m.padded_vocab_size == 50304
    assert m.rope_dims == PAPER_ROTARY_DIMS[family][percent]
    assert m.qk_norm == name.endswith("_qknorm")
    # Appendix B's optimizer and schedule.
    assert (t.train_iters, t.precision, t.zero_stage, t.seed) == (12000, "bf16", 1, 1234)
    assert (t.eval_interval, t.eval_iters, t.activation_checkpointing) == (2000, 10, True)
    o = cfg.optim
    assert (o.lr, o.betas, o.eps, o.weight_decay, o.grad_clip) == (
        4e-4,
        (0.9, 0.95),
        1e-8,
        0.1,
        1.0,
    )
    assert cfg.schedule.kind == "cosine" and cfg.schedule.warmup_fraction == 0.05
    assert o.lr * cfg.schedule.min_lr_ratio == pytest.approx(4e-5)
    edu = family == "pythia1b" or "_edu_" in name
    folder = "data/fineweb-edu100B" if edu else "data/fineweb100B"  # docs/data.md's --output
    assert cfg.data.train == [folder] and cfg.data.valid == [folder]
    assert cfg.logging.run_dir == f"runs/{name}"


def test_budget_guard(tmp_path):
    """The paper's budget is the study's rules: a sequence length that does not divide the
    tokens per step, or a Slurm layout that cannot hold the batch, is refused before anything
    is written; a 2-node layout trains the same tokens with twice the accumulation."""
    study_checkout(tmp_path)
    path = tmp_path / "studies" / "partial_rope.yaml"
    text = path.read_text()
    path.write_text(text.replace("{seq: [1024, 4096, 8192]}", "{seq: [1024, 3000]}"))
    path.write_text(
        path.read_text().replace(
            "values: [1024, 2048, 4096, 8192]", "values: [1024, 2048, 3000, 4096, 8192]"
        )
    )
    with pytest.raises(StudyError, match="train.seq_len=3000 is not in its table"):
        load_study(path)
    path.write_text(
        text.replace(
            "micro_batch_size: {train.seq_len: {1024: 128,",
            "micro_batch_size: {train.seq_len: {1024: 96,",
        )
    )
    with pytest.raises(
        StudyError,
        match=r"llama1b_seq1024_rope0 \(rule train.global_batch_size, rule train.micro_batch_size\) on 32 ranks.*96 x world size 32",
    ):
        load_study(path)
    path.write_text(text.replace("  nodes: 4\n", "  nodes: 2\n"))
    run = load_study(path).runs[0]
    t = run.config["train"]
    assert t["global_batch_size"] // (t["micro_batch_size"] * run.slurm.ranks) == 4
    assert t["global_batch_size"] * t["seq_len"] * t["train_iters"] == PAPER_TOKENS


def test_list_shows_the_budget_and_docs_hold_it():
    tool = [sys.executable, str(REPO / "tools" / "sweep.py"), "list"]
    out = subprocess.run(tool, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "run",
        "seq",
        "len",
        "global",
        "batch",
        "micro",
        "batch",
        "accum",
        "tokens/step",
        "total",
        "tokens",
        "nodes",
        "x",
        "GPUs",
    ]
    row = next(line for line in lines if line.startswith("llama1b_seq8192_rope10 "))
    assert row.split() == [
        "llama1b_seq8192_rope10",
        "8192",
        "1,024",
        "16",
        "2",
        "8,388,608",
        "100.7B",
        "4",
        "x",
        "8",
    ]
    assert len(lines) == 1 + len(paper_runs())
    md = subprocess.run([*tool, "--markdown"], capture_output=True, text=True, timeout=60).stdout
    assert md.strip() in (REPO / "docs" / "reproduce.md").read_text(), (
        "docs/reproduce.md: paste `python tools/sweep.py list --markdown`"
    )


def sbatch_options(path: Path) -> dict[str, str]:
    opts = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH ") :].partition("=")
            opts[key] = value
    return opts


@pytest.mark.parametrize("run", paper_runs(), ids=lambda r: r.name)
def test_job_script_header_and_command(run):
    path = REPO / run.script_path
    text = path.read_text()
    opts = sbatch_options(path)
    # The time limit is the plan's (pretrain/sweep_plan.json): the run at 40% MFU on executed
    # FLOPs, x 1.25 + 0.5 h, rounded up, at most 48 h.
    row = plan_rows()[run.name]
    executed_hours = row["run_hours"] * row["executed_flops"] / row["model_flops"]
    hours = min(48, math.ceil(1.25 * executed_hours + 0.5))
    assert 10 <= hours <= 48
    margin = 900 if run.name.startswith("llama8b") else 600
    assert opts == {
        "--job-name": run.name,
        "--nodes": "4",
        "--ntasks-per-node": "8",
        "--gpus-per-node": "8",
        "--cpus-per-task": "8",
        "--exclusive": "",
        "--mem": "0",
        "--time": f"{hours}:00:00",
        "--requeue": "",
        "--signal": f"B:USR1@{margin}",
        "--open-mode": "append",
        "--output": "slurm/logs/%x-%j.out",
    }
    # sbatch stops reading #SBATCH at the first command: every directive comes before it.
    commands = [i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#")]
    last_directive = max(
        i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH")
    )
    assert commands and min(commands) > last_directive
    assert text.splitlines()[commands[0]] == f'exec slurm/launch.sh {run.config_path} "$@"'
    assert os.access(path, os.X_OK)
    # The log folder exists in every checkout (Slurm fails a job whose log folder is missing).
    assert (REPO / "slurm" / "logs" / ".gitignore").is_file()


def test_signal_margin_must_fit_in_the_time_limit():
    # sbatch's formats (man sbatch, --time)
    assert [
        time_limit_s(t) for t in ("30", "10:00", "01:30:00", "2-00:00:00", "1-6", "1-6:30")
    ] == [1800, 600, 5400, 172800, 86400 + 6 * 3600, 86400 + 6 * 3600 + 1800]
    with pytest.raises(ValueError, match="signal_margin_s=600"):
        Slurm(time="00:10:00").lines("x")
    with pytest.raises(ValueError, match="signal_margin_s=600"):
        with_slurm(Run("x", "a stub"), time="00:10:00").slurm.lines("x")
    assert "#SBATCH --signal=B:USR1@600" in Slurm(time="00:10:01").lines("x")


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_bash_syntax(script):
    out = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"],
            capture_output=True,
            timeout=300,
            env=env,
        )
        path = shutil.which("shellcheck")
    if path is None:
        missing("shellcheck is not installed (apt-get install shellcheck)")
    return path


def test_shellcheck():
    out = subprocess.run(
        [shellcheck(), "-x", *SHELL_SCRIPTS], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout


def test_launcher_refuses_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        ["slurm/launch.sh", paper_runs()[0].config_path],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "not inside a Slurm job" in out.stderr


def test_sweep_cli(tmp_path, capsys):
    tool = [sys.executable, str(REPO / "tools" / "sweep.py")]
    out = subprocess.run([*tool, "check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # run-dir (slurm/submit.sh's question) in-process: the launch is the one above.
    from pretrain.cli.sweep import main

    config = str(REPO / "configs/paper/llama1b_rope10.yaml")
    capsys.readouterr()
    assert main(["run-dir", config, "--set", f"logging.run_dir={tmp_path}"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    assert main(["run-dir", config, "--set", "train.micro_batch_size=x"]) == 2
    err = capsys.readouterr().err
    assert "train.micro_batch_size" in err and len(err.strip().splitlines()) == 1


def test_char_study_configs():
    from conftest import shared_path

    thetas = (500, 1000, 5000, 10000, 20000, 50000)
    study = load_study(REPO / "studies" / "char_theta.yaml")
    names = [r.name for r in study.runs]
    assert names == [
        f"{c}_theta{t}_s{s}"
        for c in ("shakespeare", "enwik8", "text8")
        for t in thetas
        for s in (1, 2, 3)
    ]
    assert {r.config_path for r in study.runs} == {
        f"configs/char/{c}_theta{t}.yaml"
        for c in ("shakespeare", "enwik8", "text8")
        for t in thetas
    }
    run = study.runs[4]  # shakespeare, theta 1000, seed 2: the group's config and its --set
    assert run.overrides == (
        "train.seed=2",
        "logging.run_dir=runs/char/shakespeare_theta1000_s2",
    )
    assert (run.config["train"]["seed"], run.run_dir) == (2, "runs/char/shakespeare_theta1000_s2")
    assert run.group == "corpus=shakespeare,theta=1000" and study.baseline == {"theta": "10000"}
    assert study.array and run.script_path is None and study.array_script == "slurm/char_theta.sh"
    shakespeare_chars = len(set(shared_path("tinyshakespeare.txt").read_text()))
    for corpus, vocab in (
        ("shakespeare", shakespeare_chars),
        ("text8", 27),
    ):  # text8: a-z and space
        for theta in thetas:
            cfg = load_config(REPO / "configs" / "char" / f"{corpus}_theta{theta}.yaml")
            m = cfg.model
            assert (m.n_layers, m.n_heads, m.d_model, m.max_seq_len, m.dropout) == (
                6,
                6,
                384,
                256,
                0.2,
            )
            assert m.rope_theta == theta and m.learned_pos_emb and m.rope_dims == m.head_dim
            assert m.vocab_size == vocab and cfg.train.train_iters == 5000
    nano = load_config(REPO / "configs" / "char" / "nanogpt_rope_enwik8.yaml")
    assert nano.model.n_layers == 12 and not nano.model.learned_pos_emb
    (nano_run,) = load_study(REPO / "studies" / "nanogpt_rope_enwik8.yaml").runs
    assert nano_run.script_path == "slurm/nanogpt_rope_enwik8.sh"


def test_a_run_the_plan_says_does_not_fit_is_refused(tmp_path):
    study_checkout(tmp_path)
    plan = tmp_path / "pretrain" / PAPER_PLAN.name
    data = json.loads(plan.read_text())
    data["runs"][1]["fits_h200"] = False
    plan.write_text(json.dumps(data))
    with pytest.raises(
        StudyError, match="run llama1b_rope4: the plan file says it does not fit an H200"
    ):
        load_study(tmp_path / "studies" / "partial_rope.yaml")
    assert set(plan_rows()) == {r.name for r in paper_runs()}  # every run is planned
