"""checkpoint.init_from: a new run starts from another run's weights (context extension)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from train_support import baseline_run, metrics, run_main, tiny_config, write_config

from pretrain.config import Config, ModelConfig, from_dict
from pretrain.data.pipeline import build_data
from pretrain.model import Transformer
from pretrain.run_layout import STATE_FILE
from pretrain.weights import (
    WeightsError,
    find_weights_dir,
    init_from_source,
    load_weights,
    parse_init_from,
)


@dataclasses.dataclass
class _Rank:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return True


def test_step0_loss_equals_the_source_models_loss_on_the_same_batch(tmp_path_factory, tmp_path):
    """The extended run (longer max_seq_len, another theta, YaRN) logs as its first loss the
    source model's loss (with the new positions) on the first batch it trains on."""
    data, source = baseline_run(tmp_path_factory)
    cfg = tiny_config(
        tmp_path / "run",
        data,
        model={
            "max_seq_len": 64,
            "rope_theta": 20000.0,
            "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_seq_len": 32},
        },
        train={"train_iters": 2, "seq_len": 64, "eval_interval": 0},
        checkpoint={"init_from": f"{source}@6", "interval": 100},
        logging={"log_interval": 1},
    )
    r = run_main(write_config(tmp_path / "run.yaml", cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("initialised from")]
    assert f"{source}/checkpoints/step_0000006 (its step 6), every weight kept" in line
    assert "this run counting from step 0" in line
    # one line says what the surgery changed: theta, scaling, the length
    assert "model.rope_theta 10000.0 -> 20000.0" in line and "model.max_seq_len 32 -> 64" in line
    assert "model.rope_scaling None -> RopeScalingConfig(" in line
    first = metrics(tmp_path / "run")[1]["train/loss"]

    src, _ = load_weights(find_weights_dir(source, 6))
    config = from_dict(Config, cfg)
    model = Transformer(config.model)  # the new positions, the source's weights
    model.load_state_dict(src.state_dict())
    batches = build_data(config, _Rank(), 0).train_batches(config, _Rank(), 0)
    with torch.no_grad():
        losses = [model(b["input_ids"], b["labels"]).loss for b in (next(batches), next(batches))]
    assert abs(first - float(torch.stack(losses).mean())) < 1e-5


def test_a_different_shape_is_one_line_naming_the_fields(tmp_path_factory, tmp_path):
    _, source = baseline_run(tmp_path_factory)
    base = from_dict(Config, tiny_config(tmp_path, tmp_path)).model
    wider = base.replace(d_model=64, n_layers=3)
    with pytest.raises(WeightsError) as e:
        init_from_source(str(source), wider)
    msg = str(e.value)
    assert "model.n_layers 2 -> 3" in msg and "model.d_model 32 -> 64" in msg
    assert "\n" not in msg
    # head_dim written out at d_model / n_heads is the same shape; another is refused by name
    init_from_source(str(source), base.replace(head_dim=base.head_dim))
    with pytest.raises(WeightsError) as e:
        init_from_source(str(source), base.replace(head_dim=2 * base.head_dim))
    assert f"model.head_dim {base.head_dim} -> {2 * base.head_dim}" in str(e.value)
    # positions, theta and scaling may change
    longer = base.replace(max_seq_len=128, rope_theta=5e5)
    folder, cfg = init_from_source(f"{source}@6", longer)
    assert folder.name.endswith("6") and isinstance(cfg, ModelConfig)
    with pytest.raises(WeightsError, match="init_from='nowhere@3'"):
        init_from_source("nowhere@3", base)
    assert parse_init_from("runs/a@b@12") == ("runs/a@b", 12)
    assert parse_init_from("runs/x") == ("runs/x", None)


def test_the_program_refuses_a_mismatch_before_training(tmp_path_factory, tmp_path):
    data, source = baseline_run(tmp_path_factory)
    cfg = tiny_config(
        tmp_path / "run", data, model={"d_ff": 128}, checkpoint={"init_from": str(source)}
    )
    r = run_main(write_config(tmp_path / "run.yaml", cfg))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "init_from" in ln]
    assert len(lines) == 1 and "model.d_ff 64 -> 128" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_weights_file_that_is_not_safetensors_is_one_line(tmp_path_factory, tmp_path):
    """Simulates a damaged weights file (a fault): the run stops before training with one
    line naming the file and the fix, exit 2, as tools/export_hf.py does on the same folder."""
    import shutil

    data, source = baseline_run(tmp_path_factory)
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    folder = find_weights_dir(copy, 6)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    (folder / STATE_FILE).unlink()  # a weights folder without the integrity record (imported)
    cfg = tiny_config(tmp_path / "run", data, checkpoint={"init_from": f"{copy}@6"})
    r = run_main(write_config(tmp_path / "run.yaml", cfg))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.safetensors is not a safetensors file" in lines[0], r.stderr
    assert "init_from=" in lines[0] and "Traceback" not in r.stderr
