"""Training on a CUDA GPU: BF16 through DeepSpeed with FP32 accumulation, fused Adam, MFU.
Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
from train_support import metrics, prepare_stdlib, run_main, tiny_config, write_config

pytestmark = pytest.mark.gpu


def test_bf16_training_on_gpu_learns_and_reports_mfu(tmp_path):
    data = prepare_stdlib(tmp_path / "data")
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        data,
        train={
            "precision": "bf16",
            "train_iters": 40,
            "eval_interval": 20,
            "global_batch_size": 16,
            "micro_batch_size": 8,
        },
        model={"d_model": 128, "d_ff": 256, "max_seq_len": 32},
        logging={"log_interval": 10, "peak_tflops": 989.0},
    )
    r = run_main(write_config(tmp_path / "gpu.yaml", cfg), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on cuda" in r.stdout and "MFU n/a" not in r.stdout
    m = metrics(run)
    losses = [m[s]["train/loss"] for s in sorted(m) if "train/loss" in m[s]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5
    mfu = [m[s]["perf/mfu"] for s in sorted(m) if "perf/mfu" in m[s]]
    assert mfu and all(0 < x < 1 for x in mfu)
    assert m[40]["perf/peak_memory_gib"] > 0
