"""train.fp8 (pretrain/train/fp8.py): torchao's float8 training of the blocks' linears, here in
torchao's emulation (the same casts and scales, high-precision matmuls): the loss curve
stays within a measured tolerance of the high-precision run, a checkpoint written in fp8
resumes exactly, the weights (and so checkpoints and exports) stay those of a plain model,
and fp8 is refused in one line where it cannot run."""

from __future__ import annotations

import shutil

import pytest
import torch
from train_support import stdlib_data, tiny_config

from pretrain.config import Config, ConfigError, ModelConfig, from_dict
from pretrain.model.transformer import Transformer
from pretrain.preflight import check_fp8
from pretrain.run_layout import read_metrics
from pretrain.train.fp8 import convert_to_fp8, fp8_layers
from pretrain.train.trainer import Trainer

# 40 steps of the tiny config (fp32 weights), emulated fp8 against no fp8, on this machine:
# largest relative loss difference 1.3e-3 (tensorwise) and 5.3e-4 (rowwise). The bound is
# 4x the larger; a run without fp8's casts would differ by 0, one without the conversion
# working (e.g. every cast skipped) too, and that is tested below as well.
LOSS_TOLERANCE = 5e-3
STEPS = 12


def _train(tmp_path_factory, run, **train) -> list[float]:
    raw = tiny_config(
        run,
        stdlib_data(tmp_path_factory),
        train={"train_iters": STEPS, "eval_interval": 0, **train},
        checkpoint={"interval": STEPS // 2, "keep_last": 3},
        logging={"log_interval": 1},
    )
    trainer = Trainer(from_dict(Config, raw), callbacks=None)
    assert trainer.fit() == 0
    return trainer, [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_reference")
    return _train(tmp_path_factory, root / "run")[1]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_within_the_measured_tolerance_and_resumes_exactly(
    recipe, reference, tmp_path_factory, tmp_path, capsys
):
    run = tmp_path / "run"
    trainer, losses = _train(tmp_path_factory, run, fp8=recipe, fp8_emulate=True)
    model = trainer.run.module.engine.module
    assert len(fp8_layers(model)) == 4 * 2  # qkv, proj, w_in, w_out of 2 blocks
    assert f"train.fp8={recipe} (torchao's emulation): 8 linear layers in fp8" in (
        capsys.readouterr().out
    )
    assert len(losses) == len(reference) == STEPS
    worst = max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
    assert 0 < worst < LOSS_TOLERANCE, worst  # fp8's rounding shows, and stays small
    # Resume from the middle checkpoint: the second half repeats bit for bit.
    final = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{STEPS:07d}")
    (checkpoints / "latest").write_text(f"step_{STEPS // 2:07d}")
    (run / "metrics.jsonl").unlink()
    resumed, again = _train(tmp_path_factory, run, fp8=recipe, fp8_emulate=True)
    assert again == losses[STEPS // 2 :]
    for k, v in resumed.run.module.engine.module.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_fp8_layers_are_the_blocks_linears_and_the_weights_stay_plain():
    cfg = ModelConfig(
        vocab_size=100, n_layers=2, d_model=64, n_heads=4, d_ff=36, pad_vocab_to_multiple=1
    )
    model = Transformer(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = convert_to_fp8(model, "rowwise", emulate=True)
    # the MLP (2 x 36 out, 36 in: not multiples of 16) stays high precision, as the output layer
    assert (
        names
        == fp8_layers(model)
        == ["blocks.0.attn.qkv", "blocks.0.attn.proj"]
        + [
            "blocks.1.attn.qkv",
            "blocks.1.attn.proj",
        ]
    )
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    with pytest.raises(ConfigError, match=r"train\.fp8='e5m2' is unknown"):
        convert_to_fp8(Transformer(cfg), "e5m2", emulate=True)


def test_fp8_is_refused_in_one_line_where_it_cannot_run(tmp_path, monkeypatch):
    cfg = from_dict(
        Config, tiny_config(tmp_path / "run", tmp_path / "data", train={"fp8": "rowwise"})
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"^train\.fp8=rowwise needs a CUDA GPU .* train\.fp8_emulate=true"
    ):
        check_fp8(cfg)
    # A GPU before compute capability 8.9 (simulated: this machine has none)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"A100-SXM4-80GB \(compute capability 8\.0\) has no fp8"):
        check_fp8(cfg)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_fp8(cfg)  # an H100
    cfg.train.fp8_emulate = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_fp8(cfg)  # emulation runs anywhere


def test_the_planner_traces_the_fp8_model_and_counts_its_fp8_flops():
    """The plan of an fp8 run traces the converted model (torchao's casts and _scaled_mm on
    fake tensors): it holds more than the bf16 model by the casts, never less; the fp8
    share of the FLOPs is the blocks' linears', counted from the model here by hand."""
    from pretrain.planner import GPUS, plan_run

    raw = tiny_config("/tmp/unused", "/tmp/unused", model={"d_model": 64, "d_ff": 128})
    cfg = from_dict(Config, raw)
    plain = plan_run(cfg, GPUS["h100"], 1, target="cuda", compiled=False)
    cfg.train.fp8 = "tensorwise"
    fp8 = plan_run(cfg, GPUS["h100"], 1, target="cuda", compiled=False)
    assert plain.fp8_flops == 0 and plain.fp8_ideal_step_time(0.4) == plain.step_time(0.4)
    # the casts are transient: the eval forward's peak holds them, training's peak (the
    # logits' chunks, at this size) may not
    assert fp8.trace.eval > plain.trace.eval and fp8.trace.train >= plain.trace.train
    m = cfg.model
    blocks = m.n_layers * (m.d_model * 3 * m.d_model + m.d_model**2 + 3 * m.d_model * m.d_ff)
    assert fp8.fp8_flops == 6 * blocks  # q, k, v (MHA), out; SwiGLU's in (2 x d_ff) and out
    assert fp8.fp8_share == pytest.approx(6 * blocks / fp8.model_flops)
    assert fp8.fp8_ideal_step_time(0.4) == pytest.approx(
        fp8.step_time(0.4) * (1 - fp8.fp8_share / 2)
    )
