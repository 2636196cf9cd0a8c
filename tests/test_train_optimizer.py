"""The optimizer behind DeepSpeed (optim.impl): torch's fused / foreach AdamW as DeepSpeed's
client optimizer make the same updates as the optimizer DeepSpeed builds from its config
(the old path: torch's single-tensor AdamW on CPU), to fp32 rounding, through the real
engine (clipping, LR schedule, ZeRO-1; fp32 and bf16 with fp32 master weights)."""

from __future__ import annotations

import os

import pytest
import torch

from pretrain.config import Config, ConfigError, from_dict
from pretrain.train.engine import deepspeed_config, optimizer_impl

MODEL = {
    "vocab_size": 97,
    "pad_vocab_to_multiple": 1,
    "n_layers": 2,
    "d_model": 32,
    "n_heads": 4,
    "d_ff": 64,
    "max_seq_len": 16,
    "rope_fraction": 0.25,
    "qk_norm": True,
}


def _cfg(impl: str, precision: str) -> Config:
    return from_dict(
        Config,
        {
            "model": MODEL,
            "optim": {"lr": 3e-3, "impl": impl},
            "schedule": {"warmup_steps": 2},
            "train": {
                "train_iters": 6,
                "global_batch_size": 4,
                "micro_batch_size": 2,
                "seq_len": 16,
                "precision": precision,
                "zero_stage": 1,
            },
        },
    )


def _run(
    impl: str, precision: str, steps: int = 6
) -> tuple[list[float], list[list[torch.Tensor]], str]:
    """Losses of `steps` optimizer steps, fp32 weights before each step and after the last."""
    from deepspeed.utils import safe_get_full_fp32_param

    from pretrain.train import distributed as dist_utils
    from pretrain.train.engine import build_engine

    if not torch.distributed.is_initialized():
        dist_utils.setup_env()
        dist_utils.init_process_group(torch.device("cpu"))
    cfg = _cfg(impl, precision)
    engine = build_engine(cfg, 1, torch.device("cpu"), recompute=0)
    gen = torch.Generator().manual_seed(0)
    losses, params = [], []
    for i in range(steps * 2):  # 2 micro batches per step
        if i % 2 == 0:
            params.append([safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()])
        x = torch.randint(0, 97, (2, 16), generator=gen)
        y = torch.randint(0, 97, (2, 16), generator=gen)
        loss = engine(x, targets=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params.append([safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()])
    name = type(
        engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    ).__name__
    fused = engine.basic_optimizer.param_groups[0].get("fused")
    return losses, params, f"{name} fused={fused}"


def _rel(new: list[torch.Tensor], old: list[torch.Tensor]) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(new, old, strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_and_foreach_adamw_make_the_old_updates(precision):
    """One step: the fp32 master weights agree to ~1 ulp (measured 1.6e-7 relative to the
    largest weight). Six steps: to 1e-5 (measured fp32 4e-6, bf16 1.1e-7): Adam divides by
    sqrt(v), so a 1-ulp difference in a near-zero gradient of step 2 becomes a larger one
    in that weight's update; the losses agree to 1e-5. Foreach is bit-identical."""
    old_losses, old, _ = _run("deepspeed", precision)
    assert _rel(old[-1], old[0]) > 1e-3  # the steps moved the weights
    for impl in ("fused", "foreach"):
        losses, new, desc = _run(impl, precision)
        assert ("fused=True" in desc) == (impl == "fused"), desc
        tol = (0.0, 0.0) if impl == "foreach" else (5e-7, 1e-5)
        assert _rel(new[0], old[0]) == 0.0  # the same initial weights
        assert _rel(new[1], old[1]) <= tol[0], impl
        assert _rel(new[-1], old[-1]) <= tol[1], impl
        assert losses == pytest.approx(old_losses, rel=1e-5, abs=0), impl


def test_the_implementation_is_chosen_per_device():
    cfg = _cfg("auto", "bf16")
    assert optimizer_impl(cfg, torch.device("cuda")) == "deepspeed"  # DeepSpeed's FusedAdam
    assert optimizer_impl(cfg, torch.device("cpu")) == "fused"
    assert "optimizer" not in deepspeed_config(cfg, 1, torch.device("cpu"))  # a client optimizer
    assert (
        deepspeed_config(cfg, 1, torch.device("cuda"))["optimizer"]["params"]["torch_adam"] is False
    )
    old = _cfg("deepspeed", "bf16")
    assert (
        deepspeed_config(old, 1, torch.device("cpu"))["optimizer"]["params"]["torch_adam"] is True
    )
    with pytest.raises(ConfigError, match="optim.impl"):
        from_dict(Config, {"optim": {"impl": "apex"}})


def test_an_arch_list_with_suffixes_is_made_readable_for_deepspeeds_build(monkeypatch):
    """A GPU image's TORCH_CUDA_ARCH_LIST with "9.0a" stopped DeepSpeed's FusedAdam build
    (the H200 run); the list deepspeed_arch_list gives passes DeepSpeed's own parser with the
    same architectures, and a list it already reads is left as it is."""
    import importlib

    from pretrain.train.engine import deepspeed_arch_list

    # The CUDA builder itself (deepspeed.ops.op_builder resolves to the CPU one here).
    builder = importlib.import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder()
    builder.jit_mode = True

    def parsed(arch_list: str) -> str:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        builder.compute_capability_args()
        return os.environ["TORCH_CUDA_ARCH_LIST"]  # DeepSpeed writes back what it parsed

    image = "7.5 8.0;8.6 9.0a 10.0f+PTX"
    with pytest.raises(ValueError, match="invalid literal"):
        parsed(image)
    readable = deepspeed_arch_list(image)
    assert readable == "7.5;8.0;8.6;9.0;10.0+PTX"
    assert parsed(readable) == parsed("7.5;8.0;8.6;9.0;10.0+PTX")
    assert deepspeed_arch_list("8.0;9.0+PTX") == "8.0;9.0+PTX"
    assert deepspeed_arch_list(None) is None
