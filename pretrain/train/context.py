"""What a run's set-up builds, once: the frozen context the loop and the callbacks read."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pretrain.config import Config, grad_accum_steps, to_dict
from pretrain.data.pipeline import DataSource, build_data
from pretrain.eval.metrics import text_per_token
from pretrain.faults import DataFaults
from pretrain.preflight import preflight
from pretrain.run_layout import RunLayout
from pretrain.train import distributed as dist_utils
from pretrain.train.checkpoint import Checkpointer, check_init_from
from pretrain.train.distributed import DistEnv
from pretrain.train.engine import RunPlanner, build_engine, resolve_compile, resolve_recompute
from pretrain.train.fp8 import fp8_layers
from pretrain.train.module import TrainModule
from pretrain.train.recovery import warn_config_changes
from pretrain.train.state_files import seed_python_numpy


@dataclass(frozen=True)
class RunContext:
    env: DistEnv  # rank, world size, local rank
    device: torch.device
    grad_accum: int  # micro batches per optimizer step on each rank
    tokens_per_step: int  # over all ranks
    data: DataSource
    eval_enabled: bool  # validation data and train.eval_interval/eval_iters ask for it
    text_units: dict[str, float]  # bytes (and characters) per validation token, on rank 0
    module: TrainModule  # the engine, forward/backward, optimizer step, spike guard
    checkpointer: Checkpointer


def build_context(
    cfg: Config,
    layout: RunLayout,
    data: DataSource | None,
    planner: RunPlanner | None,
    log: Callable[[str], None],
) -> RunContext:
    """Process group, data, engine, training module, checkpointer: what a run builds once.
    `data` replaces the megatron-core pipeline (Trainer's argument)."""
    t = cfg.train
    env = dist_utils.setup_env()
    # Before anything draws from them (data, DeepSpeed): a fresh run's RNG files then
    # depend on the config alone; a resume restores the saved states over these.
    seed_python_numpy(t.seed, env.rank)
    device = dist_utils.device_for(env)
    check_init_from(cfg.checkpoint.init_from)
    preflight(cfg, env.world_size, check_data=data is None)
    grad_accum = grad_accum_steps(cfg, env.world_size)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist_utils.init_process_group(device)
    if env.is_main:
        layout.root.mkdir(parents=True, exist_ok=True)
        warn_config_changes(layout, to_dict(cfg), log)
    eval_enabled = (
        bool(cfg.data.valid or data is not None) and t.eval_interval > 0 and t.eval_iters > 0
    )
    if data is None:
        data = build_data(cfg, env, t.eval_iters * t.global_batch_size if eval_enabled else 0)
    eval_enabled = eval_enabled and data.valid is not None
    recompute = resolve_recompute(cfg, env.world_size, device, planner)
    compiled, why = resolve_compile(cfg, env.world_size, device, recompute, planner)
    if env.is_main:
        log(why + (", each block on its own" if compiled and t.compile_regions == "blocks" else ""))
    engine = build_engine(cfg, env.world_size, device, recompute, compiled)
    if t.fp8 != "off" and env.is_main:
        emulated = " (torchao's emulation)" if t.fp8_emulate else ""
        log(f"train.fp8={t.fp8}{emulated}: {len(fp8_layers(engine.module))} linear layers in fp8")
    faults = DataFaults(cfg.spikes.faults, t.seed, cfg.model.vocab_size, env.rank, layout)
    return RunContext(
        env=env,
        device=device,
        grad_accum=grad_accum,
        tokens_per_step=t.global_batch_size * cfg.seq_len,
        data=data,
        eval_enabled=eval_enabled,
        text_units=text_per_token(data.tokenizer, data.valid)
        if eval_enabled and env.is_main
        else {},
        module=TrainModule(cfg, engine, env.world_size, faults),
        checkpointer=Checkpointer(layout.checkpoints, cfg.checkpoint, env.rank, env.world_size),
    )
