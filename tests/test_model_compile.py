"""train.compile: the compiled model computes the eager model's loss and gradients on CPU, and
check_config refuses a compile that could not run (issue 16 item 5)."""

from __future__ import annotations

import shutil

import pytest
import torch
from train_support import tiny_config

from pretrain.config import Config, ConfigError, ModelConfig, from_dict
from pretrain.config_checks import check_compile
from pretrain.model import Transformer


def test_compiled_model_gives_the_eager_loss_and_gradients():
    cfg = ModelConfig(
        vocab_size=64,
        pad_vocab_to_multiple=1,
        n_layers=1,
        d_model=32,
        n_heads=2,
        d_ff=32,
        max_seq_len=16,
        rope_fraction=0.25,
        qk_norm=True,
    )
    torch.manual_seed(0)
    eager = Transformer(cfg)
    twin = Transformer(cfg)
    twin.load_state_dict(eager.state_dict())
    # aot_eager: dynamo capture and AOTAutograd (where our autograd.Functions and in-place
    # ops must trace) without inductor's C++ build, which takes minutes on 2 cores; the
    # inductor run is in the benchmark (tools/benchmark.py peers --compile).
    compiled = torch.compile(twin, backend="aot_eager")
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    want = eager(x, targets=x).loss
    got = compiled(x, targets=x).loss
    want.backward()
    got.backward()
    # The traced graph may decompose and reorder fp32 arithmetic: equal to rounding.
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    for (name, a), b in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def _compile_config(tmp_path) -> Config:
    cfg = tiny_config(tmp_path / "run", tmp_path / "data", train={"compile": True})
    return from_dict(Config, cfg)


def test_compile_without_a_cpu_compiler_is_refused_before_the_run(tmp_path, monkeypatch):
    cfg = _compile_config(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"train\.compile=true .* C\+\+ compiler"):
        check_compile(cfg)
    cfg.train.compile = False
    check_compile(cfg)  # off: nothing to check


def test_compile_where_dynamo_is_unsupported_is_refused(tmp_path, monkeypatch):
    cfg = _compile_config(tmp_path)
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ConfigError, match=r"train\.compile=true: .*set train\.compile=false"):
        check_compile(cfg)
