"""Checkpoints: exact resume after SIGKILL, a kill during a save, SIGUSR1 -> save and exit 99."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file
from train_support import (
    REPO,
    baseline_run,
    child_env,
    launch_cmd,
    metrics,
    run_main,
    tiny_config,
    write_config,
)

from pretrain.train.checkpoint import find_resume_tag
from pretrain.weights import find_weights_dir, load_weights


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    proc.kill()
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(lines)}")


def test_kill_during_save_then_resume_is_exact(tmp_path_factory, tmp_path):
    """SIGKILL while step 6 is being written: `latest` stays at step 3, which loads, and
    the resumed run logs the uninterrupted run's losses and reads its data, step for step."""
    data, base = baseline_run(tmp_path_factory)  # 8 steps, checkpoints every 3, uninterrupted
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(run, data))
    proc = subprocess.Popen(
        launch_cmd(cfg),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(PRETRAIN_TEST_PAUSE_AT="before_commit:6:60"),
    )
    _wait_for_line(proc, "pausing", timeout=180)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000003"
    assert (ckpts / "step_0000006.tmp").is_dir() and not (ckpts / "step_0000006").exists()
    assert find_resume_tag(ckpts) == "step_0000003"
    # The weights folder of the surviving checkpoint loads without DeepSpeed.
    model, _ = load_weights(find_weights_dir(run))
    assert model.cfg.d_model == 32
    assert max(metrics(run)) >= 6  # the killed run had trained past its checkpoint

    r = run_main(cfg)  # the same command again
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_0000003" in r.stdout
    # The budget at start: global batch 8 x seq 32 = 256 tokens per step, 8 steps.
    assert "256 tokens/step x 8 steps = 2.05K tokens" in r.stdout
    assert not (ckpts / "step_0000006.tmp").exists()
    mb, mr = metrics(base), metrics(run)
    assert sorted(mr) == list(range(1, 9))  # steps 4..6 of the killed run were replaced
    for step in range(4, 9):
        assert mr[step]["progress/batch_token_sum"] == mb[step]["progress/batch_token_sum"], step
        assert mr[step]["train/loss"] == pytest.approx(mb[step]["train/loss"], abs=1e-6), step
        assert mr[step]["train/lr"] == pytest.approx(mb[step]["train/lr"], rel=1e-12), step
    # TensorBoard, too, holds one history: the dead run's steps 4..6 are purged.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in tb] == list(range(1, 9))
    assert all(v == pytest.approx(mr[s]["train/loss"], rel=1e-6) for s, v in tb)
    wb = load_file(str(base / "checkpoints" / "step_0000008" / "model.safetensors"))
    wr = load_file(str(ckpts / "step_0000008" / "model.safetensors"))
    assert max(float((wb[k] - wr[k]).abs().max()) for k in wb) < 1e-6
    # Retention kept the newest two complete checkpoints.
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000006", "step_0000008"]
    state = json.loads((ckpts / "step_0000008" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["consumed_samples"] == 64
    assert (ckpts / "step_0000008" / "tokenizer").is_dir()


def test_sigusr1_saves_and_exits_99(tmp_path_factory, tmp_path):
    data, _ = baseline_run(tmp_path_factory)
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml",
        tiny_config(
            run,
            data,
            data={"num_workers": 2},
            train={"train_iters": 5000, "eval_interval": 0},
            checkpoint={"interval": 10_000},
            logging={"log_interval": 1, "max_logit_interval": 0},
        ),
    )
    proc = subprocess.Popen(
        launch_cmd(cfg),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    _wait_for_line(proc, "step 3/5000", timeout=180)
    # To every process of the group, DataLoader workers included, as Slurm signals a step.
    os.killpg(proc.pid, signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 99, out
    assert "SIGUSR1" in out
    tag = (run / "checkpoints" / "latest").read_text().strip()
    step = json.loads((run / "checkpoints" / tag / "trainer_state.json").read_text())["step"]
    assert 3 <= step < 5000 and tag == f"step_{step:07d}"
    assert max(metrics(run)) == step
    # A different model in the same run folder is refused, not loaded into.
    r = run_main(cfg, overrides=["model.d_model=64"])
    assert r.returncode == 2 and "holds a different model (model.d_model 32 -> 64)" in r.stderr
    # The checkpoint resumes (here into a shorter run that then finishes).
    r = run_main(cfg, overrides=[f"train.train_iters={step + 2}"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"(step {step}," in r.stdout and max(metrics(run)) == step + 2


def test_rng_state_round_trip():
    import random

    import numpy as np

    from pretrain.train.checkpoint import rng_state, set_rng_state

    state = rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a
