"""Monitoring of a real (in-process, DeepSpeed) run: loss-spike detection, TensorBoard and
JSONL scalars, MFU from the FLOPs formula; and the detector on its own."""

from __future__ import annotations

import math
import os

import pytest
import torch
from train_support import baseline_run, metrics, tiny_config

from pretrain.config import Config, from_dict
from pretrain.train.spikes import SpikeDetector

SPIKE_STEP = 40


@pytest.fixture
def isolated_env(monkeypatch):
    """train() maps launcher variables into os.environ; keep that out of the test process."""
    keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in keep})


def _config(run, data) -> Config:
    return from_dict(
        Config,
        tiny_config(
            run,
            data,
            model={"d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 64},
            train={
                "train_iters": 50,
                "global_batch_size": 8,
                "micro_batch_size": 8,
                "seq_len": 64,
                "eval_interval": 25,
                "eval_iters": 1,
            },
            schedule={"warmup_steps": 5},
            checkpoint={"interval": 1000},
            logging={"log_interval": 10, "max_logit_interval": 10},
            spikes={"window": 20, "threshold": 6.0},
        ),
    )


def _train(cfg: Config, inject_at: int | None) -> int:
    """Train on the real stdlib data; optionally replace one step's batch with random bytes."""
    from pretrain.data.dataset import build_datasets, make_loader
    from pretrain.data.pipeline import DataSource
    from pretrain.data.prefixes import tokenizer_for_data
    from pretrain.train.trainer import train

    t = cfg.train
    train_ds, valid_ds = build_datasets(
        cfg.data, cfg.seq_len, t.seed, t.train_iters * t.global_batch_size, t.global_batch_size
    )
    noise = torch.Generator().manual_seed(0)

    def loader(ds, gb, mb, rank, world, consumed, workers):
        gas = gb // (mb * world)
        for i, batch in enumerate(make_loader(ds, gb, mb, rank, world, consumed, workers)):
            if ds is train_ds and consumed // gb + i // gas + 1 == inject_at:
                x = torch.randint(0, 256, (mb, cfg.seq_len + 1), generator=noise)
                batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
            yield batch

    return train(cfg, DataSource(train_ds, valid_ds, loader, tokenizer_for_data(cfg.data)))


def test_spike_flagged_in_a_real_run_and_not_in_a_normal_one(
    tmp_path_factory, tmp_path, isolated_env, capsys
):
    data, _ = baseline_run(tmp_path_factory)
    normal, spiky = tmp_path / "normal", tmp_path / "spiky"
    assert _train(_config(normal, data), None) == 0
    assert _train(_config(spiky, data), SPIKE_STEP) == 0
    out = capsys.readouterr().out

    mn, ms = metrics(normal), metrics(spiky)
    assert mn[50]["train/loss"] < mn[1]["train/loss"] - 1.0  # it learned (so the spike stands out)
    assert not [s for s, row in mn.items() if "spikes/score" in row]
    flagged = [s for s, row in ms.items() if "spikes/score" in row]
    assert flagged and flagged[0] == SPIKE_STEP and all(s <= SPIKE_STEP + 3 for s in flagged), (
        flagged
    )
    row = ms[SPIKE_STEP]
    assert row["spikes/loss"] == row["train/loss"] and row["spikes/score"] > 6
    assert row["spikes/expected_loss"] < row["train/loss"]
    assert f"warning: loss spike at step {SPIKE_STEP}" in out

    # TensorBoard event files read back hold the same scalars as metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(spiky / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "perf/peak_memory_gib",
        "progress/samples",
        "progress/tokens",
        "valid/loss",
        "valid/ppl",
        "valid/bits_per_token",
        "stability/param_norm",
        "stability/max_attn_logit",
        "stability/max_attn_logit/layer_00",
        "stability/max_attn_logit/layer_01",
        "spikes/score",
        "spikes/loss",
        "spikes/expected_loss",
    }
    assert expected <= tags, expected - tags
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(tb_loss) == list(range(1, 51))
    assert all(tb_loss[s] == pytest.approx(ms[s]["train/loss"], rel=1e-6) for s in tb_loss)
    assert [e.step for e in acc.Scalars("valid/loss")] == [25, 50]
    assert any("spikes" in t for t in acc.Tags()["tensors"])  # the text entry

    # MFU = FLOPs/token x tokens/s / peak, FLOPs/token = 6 x matmul weights + 12 L H d_head T.
    c = _config(spiky, data).model
    matmul = (
        c.n_layers
        * (
            c.d_model * 3 * c.d_model
            + c.d_model * c.d_model
            + c.d_model * 2 * c.d_ff
            + c.d_ff * c.d_model
        )
        + c.d_model * 257
    )
    flops = 6 * matmul + 12 * c.n_layers * c.d_model * 64
    for s in (10, 20):
        assert ms[s]["perf/mfu"] == pytest.approx(
            flops * ms[s]["perf/tokens_per_s"] / 989e12, rel=1e-6
        )
        assert ms[s]["progress/tokens"] == s * 8 * 64
    # The loss reported for validation and its derived figures agree.
    v = ms[50]
    assert v["valid/ppl"] == pytest.approx(math.exp(v["valid/loss"]), rel=1e-9)
    assert v["valid/bits_per_token"] == pytest.approx(v["valid/loss"] / math.log(2), rel=1e-9)


def test_detector_flags_outliers_robustly():
    rng = torch.Generator().manual_seed(0)
    det = SpikeDetector(window=50, threshold=6.0)
    losses = (3.0 - 0.005 * torch.arange(200) + 0.02 * torch.randn(200, generator=rng)).tolist()
    losses[120] += 1.0  # a spike
    losses[121] += 0.9  # and its tail: the median ignores the spike before it
    losses[160] += 0.1  # a bump within the window's normal spread (trend + noise)
    flagged = [s for s, v in enumerate(losses) if det.update(s, v) is not None]
    assert flagged == [120, 121]
    assert det.update(500, float("nan")) is not None  # a non-finite loss is always flagged
