"""Every rule that spans more than one config field, in one place.

`pretrain/config.py` checks each field alone as it loads (types, unknown keys, the model's
own shape rules). What needs two fields, the world size or the filesystem is checked here,
once, before a process group or a model exists: batch divisibility, the schedule, sequence
lengths, precision and ZeRO, intervals, data paths, the tokenizer against the vocabulary,
and W&B. Every error is a `ConfigError` that names the field and the fix.
The engine, the schedule and the data pipeline trust what passed here.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

from pretrain.config import Config, ConfigError
from pretrain.model.recompute import check_recompute
from pretrain.model.weights import init_from_source


def world_sizes_for(global_batch_size: int, micro_batch_size: int) -> list[int]:
    """The numbers of ranks that can train a global batch in micro batches of this size
    (every divisor of the micro batches per step; none when the sizes do not divide)."""
    if global_batch_size % micro_batch_size:
        return []
    micro = global_batch_size // micro_batch_size
    return [w for w in range(1, micro + 1) if micro % w == 0]


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """global batch = micro batch x accumulation x world size; refuse what does not divide."""
    t = cfg.train
    for name in ("global_batch_size", "micro_batch_size", "train_iters"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a positive integer")
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        # A resumed run must keep its global batch: say which world sizes can hold it.
        fits = world_sizes_for(t.global_batch_size, t.micro_batch_size)
        holds = (
            f"; with this micro batch, world sizes that can hold it: "
            f"{', '.join(map(str, fits[:12]))}"
            if fits
            else ""
        )
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x world size {world_size} = {per_step}; "
            f"set train.global_batch_size to a multiple of {per_step} (e.g. {lo} or {lo + per_step}) "
            f"or change train.micro_batch_size{holds}"
        )
    return t.global_batch_size // per_step


def check_run(cfg: Config, world_size: int, check_data: bool = True) -> None:
    """All cross-field rules; `check_data=False` skips the data paths (in-memory data, or a
    recipe that builds them later). The `callbacks:` entries are checked where they are built
    (pretrain/train/callbacks/__init__.py), before the run starts too."""
    grad_accum_steps(cfg, world_size)
    _check_train(cfg)
    _check_schedule(cfg)
    _check_logging(cfg)
    _check_watchdog(cfg)
    _check_spikes(cfg, world_size)
    _check_async_checkpoint(cfg)
    if check_data:
        _check_data_fields(cfg)
        if cfg.data.recipe is None:  # a recipe builds data.train[0] at start
            check_data_paths(cfg)
        if cfg.checkpoint.init_from:
            # The source exists and has this model's shape: fail now, not after the data.
            init_from_source(cfg.checkpoint.init_from, cfg.model)
    check_wandb(cfg)
    check_downstream(cfg)
    check_fp8(cfg)


FP8_CAPABILITY = (8, 9)  # the first compute capability with fp8 tensor cores (Ada, Hopper)


def check_fp8(cfg: Config) -> None:
    """`train.fp8` where it can run (pretrain/train/fp8.py), before anything is built."""
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


def check_downstream(cfg: Config) -> None:
    """downstream.*: known tasks with local data, before anything is built (the tasks'
    lengths against the model's context need the tokenizer: the evaluator checks those at
    set-up, before the first step)."""
    d = cfg.downstream
    if not d.tasks:
        return
    # Late: the task registry lives with the evaluation layer, and only these runs need it.
    from pretrain.eval.tasks import TASKS_DIR, resolve_tasks
    from pretrain.eval.tasks.convert import EvalDataError, find_source

    for key in ("examples", "batch_size"):
        if not isinstance(getattr(d, key), int) or getattr(d, key) <= 0:
            raise ConfigError(f"downstream.{key}={getattr(d, key)!r} must be a positive integer")
    if d.interval < 0:
        raise ConfigError(
            f"downstream.interval={d.interval} must be >= 0 (steps; 0 = at the end only)"
        )
    if d.max_batch_tokens is not None and d.max_batch_tokens <= 0:
        raise ConfigError(
            f"downstream.max_batch_tokens={d.max_batch_tokens} must be positive (or null)"
        )
    offline = sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))
    try:
        tasks = resolve_tasks(",".join(d.tasks))
    except EvalDataError as e:
        raise ConfigError(f"downstream.tasks: {e}") from None
    for task in tasks:
        if task not in offline:
            raise ConfigError(
                f"downstream.tasks: unknown task {task!r}; tasks with local data: "
                f"{', '.join(offline)} (or the suite 'paper')"
            )
    if not d.data_dir:
        raise ConfigError(
            "downstream.data_dir is not set; point it at the local task data "
            "(the folder tools/evaluate.py --data-dir reads, e.g. ../shared/data/evals)"
        )
    if not Path(d.data_dir).is_dir():
        raise ConfigError(f"downstream.data_dir={d.data_dir} is not a folder on this machine")
    for task in tasks:
        try:
            find_source(task, d.data_dir)
        except EvalDataError as e:
            raise ConfigError(
                f"downstream.tasks: {e}, or leave {task} out of downstream.tasks"
            ) from None


def _check_train(cfg: Config) -> None:
    t = cfg.train
    if cfg.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            f"lower train.seq_len or raise model.max_seq_len"
        )
    if t.zero_stage not in (0, 1, 2):
        raise ConfigError(
            f"train.zero_stage={t.zero_stage} is not supported; use 0, 1 or 2 "
            f"(1 shards optimizer states, 2 also gradients)"
        )
    if t.precision == "bf16" and t.grad_accum_dtype == "fp32" and t.zero_stage == 0:
        raise ConfigError(
            "train.zero_stage=0 cannot accumulate bf16 gradients in fp32 in DeepSpeed; "
            "use train.zero_stage=1 (the paper's setting) or grad_accum_dtype=bf16"
        )
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    if cfg.optim.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip} must be >= 0 (0 = no clipping)")

    check_recompute(cfg)  # train.activation_checkpointing: none, full, N <= n_layers, auto
    if t.eval_interval < 0 or t.eval_iters < 0:
        raise ConfigError(
            "train.eval_interval and train.eval_iters must be >= 0 (0 = no evaluation)"
        )
    check_compile(cfg)


def check_compile(cfg: Config) -> None:
    """`train.compile: true` runs the model through torch.compile (DeepSpeed's
    engine.compile(), inductor backend). Refuse it here, before a process group exists, where
    it could only fail minutes later inside the first step: a Python torch.compile does not
    support, or a CPU-only machine without the C++ compiler inductor builds CPU kernels with.
    `auto` is never refused: it stays eager where compiling cannot work (resolve_compile)."""
    if cfg.train.compile is not True:
        return
    import shutil

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


def _check_schedule(cfg: Config) -> None:
    s, n = cfg.schedule, cfg.train.train_iters
    if s.warmup_steps is not None and not 0 <= s.warmup_steps <= n:
        raise ConfigError(
            f"schedule.warmup_steps={s.warmup_steps} must be in [0, train.train_iters={n}]"
        )
    if s.warmup_steps is None and not 0.0 <= (s.warmup_fraction or 0.0) <= 1.0:
        raise ConfigError(
            f"schedule.warmup_fraction={s.warmup_fraction} must be in [0, 1] "
            f"(0.05 = 5% of train_iters)"
        )
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1] "
            f"(0.1 = decay to 10% of optim.lr)"
        )


def _check_logging(cfg: Config) -> None:
    for key, value in (
        ("logging.log_interval", cfg.logging.log_interval),
        ("checkpoint.interval", cfg.checkpoint.interval),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
    ):
        if value <= 0:
            raise ConfigError(f"{key}={value} must be a positive integer")
    if cfg.logging.max_logit_interval < 0:
        raise ConfigError(
            f"logging.max_logit_interval={cfg.logging.max_logit_interval} must be >= 0 (0 = off)"
        )
    for key, path in (
        ("logging.run_dir", cfg.logging.run_dir),
        ("checkpoint.dir", cfg.checkpoint.dir),
    ):
        if path:
            _check_folder_path(key, Path(path))


def _check_async_checkpoint(cfg: Config) -> None:
    """checkpoint.async captures what DeepSpeed's torch checkpoint engine would write; a
    writer of its own (train.deepspeed's checkpoint.writer, datastates) writes other bytes."""
    ds = cfg.train.deepspeed
    other = (ds.get("checkpoint") or {}).get("writer") or (ds.get("datastates") or {}).get(
        "enabled"
    )
    if cfg.checkpoint.async_ and other:
        raise ConfigError(
            "checkpoint.async=true needs DeepSpeed's default checkpoint engine; remove "
            "train.deepspeed's checkpoint.writer (or datastates), or set checkpoint.async=false"
        )


def _check_spikes(cfg: Config, world_size: int) -> None:
    c = cfg.spikes
    if c.window < 2:
        raise ConfigError(f"spikes.window={c.window} must be >= 2")
    for key in ("threshold", "grad_norm_threshold"):
        if getattr(c, key) <= 0:
            raise ConfigError(f"spikes.{key}={getattr(c, key)} must be > 0 (a robust z-score)")
    for key in ("rollback_after", "rollback_skip_before", "rollback_skip_after", "max_rollbacks"):
        if getattr(c, key) < 0:
            raise ConfigError(f"spikes.{key}={getattr(c, key)} must be >= 0")
    if c.rollback_after and c.rollback_within < c.rollback_after:
        raise ConfigError(
            f"spikes.rollback_within={c.rollback_within} must be >= spikes.rollback_after="
            f"{c.rollback_after} (N flagged steps within M steps)"
        )
    for i, (first, last) in enumerate(c.skip_data):
        if not 1 <= first <= last:
            raise ConfigError(
                f"spikes.skip_data[{i}]=[{first}, {last}] must be [first, last] data steps with "
                f"1 <= first <= last"
            )
    for i, f in enumerate(c.faults):
        if f.step < 1:
            raise ConfigError(f"spikes.faults[{i}].step={f.step} must be >= 1")
        if f.last is not None and f.last < f.step:
            raise ConfigError(f"spikes.faults[{i}].last={f.last} must be >= step={f.step}")
        if f.kind in RANK_FAULTS:
            _check_rank_fault(cfg, f, f"spikes.faults[{i}]", world_size)
        elif f.rank is not None or f.seconds is not None:
            raise ConfigError(
                f"spikes.faults[{i}]: rank and seconds are for kind hang or slow; a {f.kind} "
                f"fault corrupts the data of every rank: remove them"
            )
        elif f.kind != "nan" and not (math.isfinite(f.factor) and f.factor != 0):
            raise ConfigError(f"spikes.faults[{i}].factor={f.factor} must be finite and non-zero")
    if cfg.train.z_loss < 0:
        raise ConfigError(f"train.z_loss={cfg.train.z_loss} must be >= 0 (0 = off; PaLM 1e-4)")


RANK_FAULTS = ("hang", "slow")


def _check_rank_fault(cfg: Config, f, key: str, world_size: int) -> None:
    """A hang or slow fault names one rank of this run; slow a delay, hang a watchdog."""
    if f.rank is None or not 0 <= f.rank < world_size:
        raise ConfigError(
            f"{key}.rank={f.rank}: a {f.kind} fault needs the rank it stalls, 0 to "
            f"{world_size - 1} for this world size of {world_size}"
        )
    if f.kind == "slow" and not (f.seconds is not None and 0 < f.seconds < math.inf):
        raise ConfigError(
            f"{key}.seconds={f.seconds}: a slow fault needs the delay per step in seconds (> 0)"
        )
    if f.kind == "hang":
        if f.seconds is not None or f.last is not None:
            raise ConfigError(
                f"{key}: a hang fault blocks for good at its step; remove seconds and last"
            )
        if not cfg.train.hang_timeout:
            raise ConfigError(
                f"{key}: a hang fault with the watchdog off (train.hang_timeout="
                f"{cfg.train.hang_timeout}) would hold the job until its time limit; set "
                f"train.hang_timeout (seconds)"
            )


def _check_watchdog(cfg: Config) -> None:
    t = cfg.train
    for key in ("hang_timeout", "hang_timeout_long"):
        value = getattr(t, key)
        if value is not None and not 0 <= value < math.inf:
            raise ConfigError(f"train.{key}={value} must be >= 0 seconds (0 or null = off)")
    if t.hang_timeout and t.hang_timeout_long is not None and t.hang_timeout_long < t.hang_timeout:
        raise ConfigError(
            f"train.hang_timeout_long={t.hang_timeout_long} must be >= train.hang_timeout="
            f"{t.hang_timeout} (it is the allowance of the slow phases: start, saves, "
            f"evaluations); null = 4 x hang_timeout"
        )


def _check_folder_path(key: str, path: Path) -> None:
    """A folder the run creates: neither it nor a folder above it may be an existing file."""
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "" if p == path else f", above {path}"
            raise ConfigError(
                f"{key}={path}: {p}{where} is a file, not a folder; choose another {key}"
            )


def _check_data_fields(cfg: Config) -> None:
    d = cfg.data
    if not d.train:
        raise ConfigError(
            "data.train is empty; give at least one prepared dataset "
            "(tools/prepare_data.py --output DIR, then data.train: [DIR])"
        )
    if d.train_weights is not None:
        if len(d.train_weights) != len(d.train):
            raise ConfigError(
                f"data.train_weights has {len(d.train_weights)} entries but "
                f"data.train has {len(d.train)}; give one weight per dataset"
            )
        if any(w < 0 for w in d.train_weights) or sum(d.train_weights) <= 0:
            raise ConfigError(
                f"data.train_weights={list(d.train_weights)} must be non-negative with a "
                f"positive sum"
            )
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be >= 0 (0 = in-process)")


def _check_data_path(key: str, path: str) -> None:
    p = Path(path)
    if p.is_dir() or (Path(path + ".bin").is_file() and Path(path + ".idx").is_file()):
        return
    raise ConfigError(
        f"{key}={path!r} not found: give a folder written by tools/prepare_data.py "
        f"or a megatron-core prefix with PREFIX.bin and PREFIX.idx"
    )


def check_data_paths(cfg: Config) -> None:
    for i, p in enumerate(cfg.data.train):
        _check_data_path(f"data.train[{i}]", p)
    for i, p in enumerate(cfg.data.valid):
        _check_data_path(f"data.valid[{i}]", p)


def check_vocab(cfg: Config, tokenizer_vocab_size: int) -> None:
    """The model's vocabulary must hold every id the tokenizer of the data can produce."""
    if tokenizer_vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab_size}); set model.vocab_size={tokenizer_vocab_size}"
        )


def check_wandb(cfg: Config) -> None:
    if cfg.wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "wandb.enabled=true but wandb is not installed; pip install wandb, "
            "or --set wandb.enabled=false"
        )


__all__ = [
    "FP8_CAPABILITY",
    "check_compile",
    "check_fp8",
    "check_run",
    "check_data_paths",
    "check_vocab",
    "check_wandb",
    "grad_accum_steps",
    "world_sizes_for",
]
