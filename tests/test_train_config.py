"""Bad run configs fail at once with one line that names the key or path and the fix."""

from __future__ import annotations

import os

import pytest
import yaml
from train_support import REPO, tiny_config, write_config

from pretrain.cli.train import main
from pretrain.config import Config, from_dict, grad_accum_steps, load_config
from pretrain.train.engine import deepspeed_config


@pytest.fixture
def isolated_env(monkeypatch):
    """main() maps launcher variables into os.environ; keep that out of the test process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    monkeypatch.setattr(os, "environ", env)
    return env


def _error(capsys, tmp_path, cfg, overrides=()):
    path = write_config(tmp_path / "run.yaml", cfg)
    argv = ["--config", str(path)]
    for o in overrides:
        argv += ["--set", o]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


def test_unknown_key_is_named_with_a_suggestion(tmp_path, capsys, isolated_env):
    cfg = tiny_config(tmp_path / "run", tmp_path, train={"micro_batch_sise": 4})
    err = _error(capsys, tmp_path, cfg)
    assert "train.micro_batch_sise" in err and "micro_batch_size" in err


def test_wrong_type_from_the_command_line(tmp_path, capsys, isolated_env):
    err = _error(capsys, tmp_path, tiny_config(tmp_path / "run", tmp_path), ["optim.lr=fast"])
    assert "optim.lr" in err and "number" in err


def test_indivisible_batch_names_both_keys_and_a_fix(tmp_path, capsys, isolated_env):
    data = tmp_path / "data"
    data.mkdir()
    cfg = tiny_config(
        tmp_path / "run", data, train={"global_batch_size": 10, "micro_batch_size": 4}
    )
    err = _error(capsys, tmp_path, cfg)
    assert "train.global_batch_size=10" in err and "train.micro_batch_size=4" in err
    assert "multiple of 4" in err


def test_missing_data_path_is_named(tmp_path, capsys, isolated_env):
    missing = tmp_path / "nowhere" / "fineweb"
    cfg = tiny_config(tmp_path / "run", missing)
    err = _error(capsys, tmp_path, cfg)
    assert "data.train[0]" in err and str(missing) in err


def test_world_size_divisibility_and_the_generated_deepspeed_config(tmp_path):
    """The paper's batch: 4096 = 64 x 2 x 32 GPUs (1B); bf16 with fp32 accumulation and reduce."""
    path = write_config(
        tmp_path / "p.yaml", {"inherit": {"model": str(REPO / "configs/models/llama1b.yaml")}}
    )
    cfg = load_config(path)
    assert grad_accum_steps(cfg, 32) == 2
    import torch

    ds = deepspeed_config(cfg, 32, torch.device("cuda"))
    assert ds["train_batch_size"] == 4096 and ds["train_micro_batch_size_per_gpu"] == 64
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": True}
    assert (
        ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    )
    assert ds["zero_optimization"] == {"stage": 1}
    p = ds["optimizer"]["params"]
    assert (p["lr"], p["betas"], p["eps"], p["weight_decay"]) == (4e-4, [0.9, 0.95], 1e-8, 0.1)
    assert p["torch_adam"] is False  # DeepSpeed's fused Adam on GPU
    with pytest.raises(Exception, match="multiple of 1920"):
        grad_accum_steps(cfg, 30)
    # Extra DeepSpeed keys pass through and win.
    cfg2 = load_config(
        path, ["train.deepspeed={zero_optimization: {stage: 2, overlap_comm: true}}"]
    )
    assert deepspeed_config(cfg2, 32, torch.device("cpu"))["zero_optimization"] == {
        "stage": 2,
        "overlap_comm": True,
    }


def test_quickstart_config_loads_and_resolves():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    assert isinstance(cfg, Config)
    assert cfg.model.qk_norm and cfg.model.rope_dims == 4 and cfg.model.head_dim == 32
    assert (
        yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["data"]["recipe"]
        == "stdlib"
    )


def test_weight_decay_groups_follow_the_config():
    """Matrices decay; norms and biases do not (GPT-NeoX); embeddings as configured."""
    from pretrain.model.transformer import Transformer
    from pretrain.train.engine import param_groups

    model_cfg = {
        "vocab_size": 64,
        "pad_vocab_to_multiple": 1,
        "n_layers": 2,
        "d_model": 32,
        "n_heads": 4,
        "d_ff": 64,
        "max_seq_len": 16,
        "qk_norm": True,
        "mlp_bias": True,
    }
    for decay_emb in (True, False):
        cfg = from_dict(Config, {"model": model_cfg, "optim": {"decay_embeddings": decay_emb}})
        model = Transformer(cfg.model)
        groups = param_groups(model, cfg)
        decayed = {id(p) for p in groups[0]["params"]}
        assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
        names = {id(p): n for n, p in model.named_parameters()}
        for pid, name in names.items():
            is_matrix = name.endswith("weight") and "norm" not in name and name != "wte.weight"
            expect = is_matrix or (name == "wte.weight" and decay_emb)
            assert (pid in decayed) == expect, name
        assert sum(len(g["params"]) for g in groups) == len(names)
