"""Data parallelism and gradient accumulation through the real DeepSpeed engine (CPU, gloo).

The same global batch must give the same training whatever the split: 1 rank x 2 micro
batches of 4, 2 ranks x 1 micro batch of 4, 1 rank x 1 micro batch of 8.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from train_support import baseline_run, metrics, run_main, tiny_config, write_config

STEPS = 8


def _weights(run):
    return load_file(str(run / "checkpoints" / f"step_{STEPS:07d}" / "model.safetensors"))


def _compare(run_a, run_b, weight_tol, loss_tol):
    ma, mb = metrics(run_a), metrics(run_b)
    assert sorted(ma) == sorted(mb) == list(range(1, STEPS + 1))
    for step in ma:
        # The very same samples, and the same mean loss over the global batch.
        assert ma[step]["progress/batch_token_sum"] == mb[step]["progress/batch_token_sum"], step
        assert ma[step]["train/loss"] == pytest.approx(mb[step]["train/loss"], abs=loss_tol), step
    wa, wb = _weights(run_a), _weights(run_b)
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert diff < weight_tol, diff
    # Training moved the weights (so equal weights are not a trivial outcome).
    w0 = load_file(str(run_a / "checkpoints" / "step_0000006" / "model.safetensors"))
    assert max(float((wa[k] - w0[k]).abs().max()) for k in wa) > 1e-4


def test_two_ranks_equal_one_rank(tmp_path_factory, tmp_path):
    data, base = baseline_run(tmp_path_factory)  # 1 rank: micro 4 x accumulation 2
    run = tmp_path / "dp2"
    cfg = write_config(tmp_path / "dp2.yaml", tiny_config(run, data))
    r = run_main(cfg, nproc=2, torchrun=True)  # 2 ranks on gloo: micro 4 x accumulation 1 x 2
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 rank(s)" in r.stdout and "4 x 1 accumulation x 2 ranks" in r.stdout
    _compare(base, run, weight_tol=1e-5, loss_tol=1e-6)


def test_accumulation_equals_one_big_micro_batch(tmp_path_factory, tmp_path):
    data, base = baseline_run(tmp_path_factory)  # micro 4 x 2
    run = tmp_path / "mb8"
    cfg = write_config(tmp_path / "mb8.yaml", tiny_config(run, data, train={"micro_batch_size": 8}))
    r = run_main(cfg)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "8 x 1 accumulation x 1 ranks" in r.stdout
    _compare(base, run, weight_tol=1e-5, loss_tol=1e-5)


def test_position_variants_train_alike_on_two_ranks(tmp_path_factory, tmp_path):
    """Issue 36's encodings in one model (NoPE on every 2nd layer, a sliding window of 8 on
    all but every 2nd layer, ALiBi on every layer, positions reset at each document): 2 ranks
    train as 1 does, and differently from the plain model (so the settings took effect)."""
    data, base = baseline_run(tmp_path_factory)
    model = {"nope_every": 2, "sliding_window": 8, "sliding_window_pattern": 2, "alibi": True}
    runs = {}
    for nproc in (1, 2):
        run = tmp_path / f"variant_{nproc}"
        raw = tiny_config(run, data, model=model, data={"position_reset": True})
        r = run_main(write_config(tmp_path / f"variant_{nproc}.yaml", raw), nproc=nproc)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[nproc] = run
    _compare(runs[1], runs[2], weight_tol=1e-5, loss_tol=1e-6)
    plain, variant = metrics(base), metrics(runs[1])
    assert plain[STEPS]["train/loss"] != pytest.approx(variant[STEPS]["train/loss"], abs=1e-4)
