"""What a run needs of this machine, checked when a program starts, before anything is built:
the launch's world size, the data and weights on this filesystem, a GPU with fp8, a C++
compiler for torch.compile on CPU, wandb, the downstream tasks' data. A study never calls it,
so a GPU study plans and submits from a CPU login node; the same run started on a CPU node is
refused in one line (a `ConfigError` naming the field and the fix).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from pretrain.config import Config, ConfigError, check_world_size
from pretrain.data.config import check_data_paths
from pretrain.eval.tasks import resolve_tasks
from pretrain.eval.tasks.convert import EvalDataError, find_source
from pretrain.weights import init_from_source

FP8_CAPABILITY = (8, 9)  # the first compute capability with fp8 tensor cores (Ada, Hopper)


def preflight(cfg: Config, world_size: int, check_data: bool = True) -> None:
    """Every check of `cfg` against this machine and launch; `check_data=False` skips the
    data (in-memory data). `callbacks:` are checked where they are built, before the run too."""
    check_world_size(cfg, world_size)
    # What this machine is first (a study's GPU run started on a CPU node), then its files.
    check_fp8(cfg)
    check_compile(cfg)
    check_wandb(cfg)
    check_folder_path("logging.run_dir", cfg.logging.run_dir)
    check_folder_path("checkpoint.dir", cfg.checkpoint.dir)
    if check_data:
        if not cfg.data.train:
            raise ConfigError(
                "data.train is empty; give at least one prepared dataset "
                "(tools/prepare_data.py --output DIR, then data.train: [DIR])"
            )
        if cfg.data.recipe is None:  # a recipe builds data.train[0] at start
            check_data_paths(cfg.data)
        if cfg.checkpoint.init_from:
            # The source exists and has this model's shape: fail now, not after the data.
            init_from_source(cfg.checkpoint.init_from, cfg.model)
    check_downstream_data(cfg)


def check_folder_path(key: str, folder: str | None) -> None:
    """A folder the run creates (when set): neither it nor one above it may be an existing file."""
    if not folder:
        return
    path = Path(folder)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "" if p == path else f", above {path}"
            raise ConfigError(
                f"{key}={path}: {p}{where} is a file, not a folder; choose another {key}"
            )


def check_fp8(cfg: Config) -> None:
    """`train.fp8` where it can run (pretrain/train/fp8.py): a GPU of capability 8.9+."""
    t = cfg.train
    if t.fp8 == "off" or t.fp8_emulate:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"train.fp8={t.fp8} needs a CUDA GPU with fp8 (compute capability 8.9+: L4, L40, "
            f"H100, H200); on CPU set train.fp8_emulate=true (torchao's emulation: fp8 "
            f"numerics, not speed) or train.fp8=off"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        raise ConfigError(
            f"train.fp8={t.fp8}: {torch.cuda.get_device_name()} (compute capability "
            f"{capability[0]}.{capability[1]}) has no fp8 matmuls (8.9+: L4, L40, H100, H200); "
            f"set train.fp8=off"
        )


def check_compile(cfg: Config) -> None:
    """Refuse `train.compile: true` where it would fail minutes later in the first step: no
    torch.compile on this Python, or no C++ compiler for inductor's CPU kernels. `auto` is never
    refused: it stays eager where compiling cannot work."""
    if cfg.train.compile is not True:
        return
    import torch

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            f"train.compile=true: torch {torch.__version__} has no torch.compile on this Python; "
            f"set train.compile=false"
        )
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if not torch.cuda.is_available() and compiler is None:
        raise ConfigError(
            "train.compile=true on a machine without CUDA needs a C++ compiler (c++ or g++ on "
            "PATH, or $CXX): torch.compile's inductor backend builds CPU kernels with it; "
            "install one (e.g. apt-get install g++) or set train.compile=false"
        )


def check_wandb(cfg: Config) -> None:
    if cfg.wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "wandb.enabled=true but wandb is not installed; pip install wandb, "
            "or --set wandb.enabled=false"
        )


def check_downstream_data(cfg: Config) -> None:
    """downstream.data_dir holds the data of every task (their names the config checked; their
    lengths against the model's context need the tokenizer: the evaluator checks those)."""
    d = cfg.downstream
    if not d.tasks:
        return
    if not d.data_dir:
        raise ConfigError(
            "downstream.data_dir is not set; point it at the local task data "
            "(the folder tools/evaluate.py --data-dir reads, e.g. ../shared/data/evals)"
        )
    if not Path(d.data_dir).is_dir():
        raise ConfigError(f"downstream.data_dir={d.data_dir} is not a folder on this machine")
    for task in resolve_tasks(",".join(d.tasks)):
        try:
            find_source(task, d.data_dir)
        except EvalDataError as e:
            raise ConfigError(
                f"downstream.tasks: {e}, or leave {task} out of downstream.tasks"
            ) from None
