"""Training with document masking, position reset and the end-of-document loss mask on, through
the real DeepSpeed engine (CPU, gloo): it trains on the same data as without them, to other
numbers; 2 ranks killed with SIGKILL and resumed equal 1 uninterrupted rank."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from train_support import metrics, run_main, tiny_config, write_config

SWITCHES = {"document_mask": True, "position_reset": True, "eod_mask_loss": True}
_runs: dict[str, object] = {}


def paragraphs(tmp_path_factory):
    """Tiny Shakespeare by paragraph: documents of a few dozen bytes, so that every sample of
    32 tokens holds several (the stdlib corpus's files are longer than a sample)."""
    from conftest import shared_path

    from pretrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("paragraphs") / "data"
    prepare(
        out,
        "bytes",
        inputs=[str(shared_path("tinyshakespeare.txt"))],
        txt_mode="paragraph",
        valid_fraction=0.1,
        workers=1,
        progress=False,
    )
    return out


def config(tmp_path, data, name, masked=True):
    cfg = tiny_config(tmp_path / name, data)
    if masked:
        cfg["data"].update(SWITCHES)
    return write_config(tmp_path / f"{name}.yaml", cfg), tmp_path / name


def runs(tmp_path_factory):
    """The tiny config on paragraphs, trained once without and once with every switch on,
    on one rank, uninterrupted."""
    if not _runs:
        data = paragraphs(tmp_path_factory)
        root = tmp_path_factory.mktemp("documents")
        for name in ("plain", "masked"):
            cfg, run = config(root, data, name, masked=name == "masked")
            r = run_main(cfg)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            _runs[name] = run
        _runs["data"] = data
    return _runs["data"], _runs["plain"], _runs["masked"]


def _weights(run, step=8):
    return load_file(str(run / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


def test_switches_train_the_same_data_to_other_numbers(tmp_path_factory):
    _, plain, run = runs(tmp_path_factory)
    mp, mm = metrics(plain), metrics(run)
    assert sorted(mp) == sorted(mm) == list(range(1, 9))
    for step in mp:  # the very same tokens
        assert mm[step]["progress/batch_token_sum"] == mp[step]["progress/batch_token_sum"]
    # Step 1 starts from the same weights: masking changes the loss already there.
    assert abs(mm[1]["train/loss"] - mp[1]["train/loss"]) > 1e-4
    assert all(abs(mm[s]["train/loss"] - mp[s]["train/loss"]) > 1e-4 for s in mp)
    assert mm[8]["valid/loss"] != mp[8]["valid/loss"]


def test_two_ranks_killed_then_resumed_equal_one_uninterrupted_rank(tmp_path_factory, tmp_path):
    """2 ranks with masking, SIGKILLed while step 6 is saved (after the step-3 checkpoint),
    then the same command again: step for step the losses and data of one uninterrupted rank
    (2 ranks = 1, and the resume exact, with the document inputs on)."""
    data, _, base = runs(tmp_path_factory)
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
