"""Training with document masking, position reset and the end-of-document loss mask on, through
the real DeepSpeed engine (CPU, gloo): it trains on the same data as without them, to other
numbers; 2 ranks killed with SIGKILL and resumed equal 1 uninterrupted rank."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from train_support import metrics, run_main, tiny_config, write_config

SWITCHES = {"document_mask": True, "position_reset": True, "eod_mask_loss": True}


def config(tmp_path, data, name, masked=True):
    cfg = tiny_config(tmp_path / name, data)
    if masked:
        cfg["data"].update(SWITCHES)
    return write_config(tmp_path / f"{name}.yaml", cfg), tmp_path / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, paragraphs):
    """(data, plain run, masked run): the tiny config on paragraphs, trained once without and
    once with every switch on, on one rank, uninterrupted."""
    root = tmp_path_factory.mktemp("documents")
    out = [paragraphs]
    for name in ("plain", "masked"):
        cfg, run = config(root, paragraphs, name, masked=name == "masked")
        r = run_main(cfg)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out.append(run)
    return tuple(out)


def _weights(run, step=8):
    return load_file(str(run / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


def test_switches_train_the_same_data_to_other_numbers(runs):
    _, plain, run = runs
    mp, mm = metrics(plain), metrics(run)
    assert sorted(mp) == sorted(mm) == list(range(1, 9))
    for step in mp:  # the very same tokens
        assert mm[step]["progress/batch_token_sum"] == mp[step]["progress/batch_token_sum"]
    # Step 1 starts from the same weights: masking changes the loss already there.
    assert abs(mm[1]["train/loss"] - mp[1]["train/loss"]) > 1e-4
    assert all(abs(mm[s]["train/loss"] - mp[s]["train/loss"]) > 1e-4 for s in mp)
    assert mm[8]["valid/loss"] != mp[8]["valid/loss"]


def test_two_ranks_killed_then_resumed_equal_one_uninterrupted_rank(runs, tmp_path):
    """2 ranks with masking, SIGKILLed while step 6 is saved (after the step-3 checkpoint),
    then the same command again: step for step the losses and data of one uninterrupted rank
    (2 ranks = 1, and the resume exact, with the document inputs on)."""
    data, _, base = runs
    cfg, run = config(tmp_path, data, "dp2")
    killed = run_main(cfg, nproc=2, PRETRAIN_TEST_KILL_AT="before_commit:6")
    assert killed.returncode != 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000003"
    assert max(metrics(run)) >= 6  # it had trained past its checkpoint
    r = run_main(cfg, nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "2 rank(s)" in r.stdout
    mb, mr = metrics(base), metrics(run)
    assert sorted(mr) == list(range(1, 9))
    for step in range(1, 9):
        assert mr[step]["progress/batch_token_sum"] == mb[step]["progress/batch_token_sum"]
        assert mr[step]["train/loss"] == pytest.approx(mb[step]["train/loss"], abs=1e-6), step
    wb, wr = _weights(base), _weights(run)
    assert max(float((wb[k] - wr[k]).abs().max()) for k in wb) < 1e-5
