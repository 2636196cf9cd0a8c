"""DeepSpeed set-up: the engine, its optimizer, precision and ZeRO, from our one config.

DeepSpeed owns the step: BF16 (or FP32) compute, gradient accumulation in FP32, FP32
all-reduce, ZeRO 1/2, clipping, AdamW and the LR scheduler. The AdamW is DeepSpeed's
FusedAdam on CUDA and torch's fused AdamW (a client optimizer) on CPU; see `optimizer_impl`.
Its config is generated from ours (`deepspeed_config`), so batch sizes cannot disagree;
`train.deepspeed` merges extra keys over it for advanced users. The loop that drives the
engine is pretrain/train/trainer.py; what the toolkit does to DeepSpeed beyond its documented
API is in pretrain/train/deepspeed_adapter.py.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any, Protocol

import torch

from pretrain.config import Config, ConfigError, deep_merge, grad_accum_steps
from pretrain.model.loss import linear_cross_entropy
from pretrain.model.recompute import KEY as RECOMPUTE_KEY
from pretrain.model.recompute import recompute_layers
from pretrain.model.transformer import Transformer
from pretrain.train import deepspeed_adapter
from pretrain.train.fp8 import convert_to_fp8
from pretrain.train.schedule import make_scheduler
from pretrain.train.spikes import SkipStepOptimizer
from pretrain.weights import load_initial_weights

AUTO_COMPILE = "auto"  # train.compile's default: resolve_compile decides per device


def deepspeed_config(cfg: Config, world_size: int, device: torch.device) -> dict[str, Any]:
    t, o = cfg.train, cfg.optim
    gas = grad_accum_steps(cfg, world_size)
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "steps_per_print": 2**31 - 1,  # we log; DeepSpeed's own step lines stay quiet
        "wall_clock_breakdown": False,
    }
    if optimizer_impl(cfg, device) == "deepspeed":
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                # On CUDA DeepSpeed's FusedAdam; elsewhere torch's (single-tensor) AdamW
                # instead of a ~70 s JIT-compiled CPU Adam.
                "torch_adam": device.type != "cuda",
            },
        }
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        # The paper: forward/backward in BF16, gradient accumulation and reductions in FP32.
        ds["data_types"] = {"grad_accum_dtype": t.grad_accum_dtype}
        ds["communication_data_type"] = "fp32"
    return deep_merge(ds, t.deepspeed)


def _torch_fused_supported(device: torch.device) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def optimizer_impl(cfg: Config, device: torch.device) -> str:
    """Which AdamW runs the step on `device`: "deepspeed", "fused" or "foreach" (optim.impl
    resolved). "auto": DeepSpeed's FusedAdam on CUDA (one multi-tensor kernel, as fast as
    torch's fused there, and what the GPU plan models); torch's fused AdamW elsewhere when
    the device has the kernel (CPU: ~5x the single-tensor loop, docs/speed.md), else
    torch's foreach AdamW. A user's own `train.deepspeed.optimizer` block always wins."""
    impl = cfg.optim.impl
    if "optimizer" in cfg.train.deepspeed:
        return "deepspeed"
    if impl == "auto":
        if device.type == "cuda":
            return "deepspeed"
        return "fused" if _torch_fused_supported(device) else "foreach"
    if impl == "fused" and not _torch_fused_supported(device):
        raise ConfigError(
            f"optim.impl=fused: torch has no fused AdamW for {device.type}; use auto or foreach"
        )
    return impl


def build_optimizer(
    cfg: Config, model: Transformer, device: torch.device
) -> torch.optim.Optimizer | None:
    """The client optimizer handed to DeepSpeed (None: DeepSpeed builds its own from the config).

    DeepSpeed wraps any torch optimizer the same way as its own: under bf16 + ZeRO-1
    (BF16_Optimizer) and ZeRO-1/2 (DeepSpeedZeroOptimizer) it replaces the groups' params
    with the rank's flat fp32 master partition, so the fused kernel steps one tensor per group.
    """
    impl = optimizer_impl(cfg, device)
    if impl == "deepspeed":
        return None
    o = cfg.optim
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def param_groups(model: Transformer, cfg: Config) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices; norms, biases (and embeddings) as configured."""
    embeddings = {id(model.wte.weight)} | (
        {id(model.wpe.weight)} if model.wpe is not None else set()
    )
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied matrix once
        if not p.requires_grad:
            continue
        if id(p) in embeddings:
            (decay if cfg.optim.decay_embeddings else no_decay).append(p)
        elif p.ndim < 2:
            (decay if cfg.optim.decay_norms_and_biases else no_decay).append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


# (config, world size, device) -> blocks to recompute: how a program resolves
class RunPlanner(Protocol):
    """Decides a config's "auto" fields for the device a run got, before the engine is built.
    The program passes the planner's (pretrain/cli/train.py); training itself never imports
    the planner, which loads torch's fake-tensor machinery."""

    def recompute(self, cfg: Config, world_size: int, device: torch.device) -> int:
        """`activation_checkpointing: auto`: the blocks to recompute."""
        ...

    def compiled_fits(
        self, cfg: Config, world_size: int, device: torch.device, layers: int
    ) -> bool:
        """`compile: auto`: whether the compiled step's planned peak fits this device."""
        ...


def resolve_recompute(
    cfg: Config, world_size: int, device: torch.device, planner: RunPlanner | None
) -> int:
    """Blocks to recompute: the config's number, or what `planner` decides for `auto`."""
    layers = recompute_layers(cfg.train.activation_checkpointing, cfg.model.n_layers)
    if layers is not None:
        return layers
    if planner is None:
        raise ConfigError(
            f"{RECOMPUTE_KEY}='auto' needs the planner: start the run with pretrain/main.py "
            f"(it plans the recompute), or give a number of layers, 'none' or 'full'"
        )
    return planner.recompute(cfg, world_size, device)


def resolve_compile(
    cfg: Config,
    world_size: int,
    device: torch.device,
    layers: int,
    planner: RunPlanner | None,
) -> tuple[bool, str]:
    """Whether the engine is compiled, and why (the run's log says it). `true`/`false` are
    the user's (check_compile has refused `true` where it cannot work); `auto` compiles on
    CUDA, where it is 14-18% faster per step (docs/speed.md), unless torch.compile
    cannot run here or the planner says the compiled step would not fit where the eager one
    does: inductor's graph holds more than the eager model for parallel blocks (+12-13% on
    pythia1b, measured on an H100 and an H200), and `auto` must never turn a fitting run into
    an out-of-memory error. Without a planner (a Trainer built in code) it compiles unplanned."""
    value = cfg.train.compile
    if value != AUTO_COMPILE:
        return bool(value), f"train.compile={str(value).lower()}"
    if device.type != "cuda":
        return False, (
            "train.compile=auto: eager on CPU (inductor's CPU build takes minutes; set "
            "train.compile=true to compile anyway)"
        )
    if not torch._dynamo.is_dynamo_supported():
        return False, f"train.compile=auto: eager, torch {torch.__version__} cannot compile here"
    if planner is not None and not planner.compiled_fits(cfg, world_size, device, layers):
        return False, (
            "train.compile=auto: eager, the compiled step's planned peak does not fit this GPU "
            "(tools/plan.py CONFIG shows both; lower the micro batch or recompute to compile)"
        )
    planned = "" if planner is not None else " (memory not planned: no planner given)"
    return True, f"train.compile=auto: compiled on CUDA{planned}"


ARCH_LIST = "TORCH_CUDA_ARCH_LIST"


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's JIT builder can read it (None: unset).
    torch takes architecture-specific entries ("9.0a", "10.0f"); DeepSpeed reads each part
    as a number and stops FusedAdam's build with "invalid literal for int() with base 10:
    '0a'", as it did on a GPU image whose list holds 9.0a. FusedAdam uses nothing
    architecture-specific, so the suffix goes; the architectures stay."""
    if value is None:
        return None
    out: list[str] = []
    for entry in value.replace(";", " ").split():
        m = re.fullmatch(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", entry)
        fixed = f"{m[1]}.{m[2]}{m[3] or ''}" if m else entry
        if fixed not in out:
            out.append(fixed)
    return ";".join(out)


def build_engine(
    cfg: Config, world_size: int, device: torch.device, recompute: int, compiled: bool = False
):
    """The model, built where it trains (an 8B model never sits in host memory), wrapped in a
    DeepSpeed engine with AdamW and our LR schedule, the optimizer it steps wrapped for the
    spike guard (SkipStepOptimizer). Same seed on every rank: identical initial weights
    (DeepSpeed also broadcasts them). `recompute`: the number of blocks whose activations the
    backward recomputes, `compiled`: whether torch.compile runs the engine's model (both
    "auto" already resolved: resolve_recompute, resolve_compile)."""
    deepspeed_adapter.quiet_logs()  # imports DeepSpeed before the seed, as it always was
    t = cfg.train
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = Transformer(cfg.model)
    if cfg.checkpoint.init_from:
        # Before DeepSpeed copies the parameters into its fp32 master partitions. A resume
        # of this run's own checkpoint then overwrites them (and the optimizer state).
        load_initial_weights(model, cfg.checkpoint.init_from)
    model.gradient_checkpointing = recompute
    if t.fp8 != "off":  # before DeepSpeed: it wraps (and casts) the converted layers
        convert_to_fp8(model, t.fp8, t.fp8_emulate)
    if compiled and t.compile_regions == "blocks":
        deepspeed_adapter.compile_blocks(model.blocks)
    if device.type == "cuda" and optimizer_impl(cfg, device) == "deepspeed":
        readable = deepspeed_arch_list(os.environ.get(ARCH_LIST))
        if readable is not None and readable != os.environ[ARCH_LIST]:
            logging.getLogger("pretrain").info(
                "%s=%s -> %s for DeepSpeed's FusedAdam build (it cannot parse the suffixes)",
                ARCH_LIST,
                os.environ[ARCH_LIST],
                readable,
            )
            os.environ[ARCH_LIST] = readable
    if t.loss_backend != "chunked":
        model.loss_fn = functools.partial(linear_cross_entropy, backend=t.loss_backend)
    engine = deepspeed_adapter.initialize(
        model=model,
        optimizer=build_optimizer(cfg, model, device),
        model_parameters=param_groups(model, cfg),
        config=deepspeed_config(cfg, world_size, device),
        lr_scheduler=lambda opt: make_scheduler(opt, cfg.optim.lr, cfg.schedule, t.train_iters),
    )
    deepspeed_adapter.wrap_stepped_optimizer(engine, SkipStepOptimizer)
    if compiled and t.compile_regions == "model":
        deepspeed_adapter.compile_engine(engine)
    return engine
