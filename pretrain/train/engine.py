"""DeepSpeed set-up and the training loop.

DeepSpeed owns the step: BF16 (or FP32) compute, gradient accumulation in FP32, FP32
all-reduce, ZeRO 1/2, clipping, AdamW and the LR scheduler. Its config is generated from
ours (`deepspeed_config`), so batch sizes cannot disagree; `train.deepspeed` merges extra
keys over it for advanced users.

The loop, per optimizer step: `grad_accum` micro batches of forward + backward through the
engine, one all-reduce of [loss, stop flag] (the step's global mean loss, and whether any
rank received SIGTERM/SIGUSR1), then logging, spike detection, evaluation and
checkpointing at their intervals. A signal saves a checkpoint after the current step and
the process exits with EXIT_PREEMPTED (99), which Slurm scripts requeue on.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from pretrain.config import Config, ConfigError, deep_merge, to_dict
from pretrain.model.transformer import Transformer
from pretrain.model.weights import save_weights, step_tag
from pretrain.plan import resolve_activation_checkpointing
from pretrain.train import distributed as dist_utils
from pretrain.train.checkpoint import Checkpointer, checkpoints_dir, find_resume_tag, read_state
from pretrain.train.monitor import Monitor, SpikeDetector, Throughput, format_eta
from pretrain.train.schedule import make_scheduler
from pretrain.train.schedule import validate as validate_schedule

EXIT_OK = 0
EXIT_PREEMPTED = 99  # a signal-triggered checkpoint was written; requeue and re-run
RUN_CONFIG_FILE = "config.yaml"


# ----------------------------------------------------------------------------- validation


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """global batch = micro batch x accumulation x world size; refuse what does not divide."""
    t = cfg.train
    for name in ("global_batch_size", "micro_batch_size", "train_iters"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a positive integer")
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x world size {world_size} = {per_step}; "
            f"set train.global_batch_size to a multiple of {per_step} (e.g. {lo} or {lo + per_step}) "
            f"or change train.micro_batch_size"
        )
    return t.global_batch_size // per_step


def _check_data_path(key: str, path: str) -> None:
    p = Path(path)
    if p.is_dir() or (Path(path + ".bin").is_file() and Path(path + ".idx").is_file()):
        return
    raise ConfigError(
        f"{key}={path!r} not found: give a folder written by tools/prepare_data.py "
        f"or a megatron-core prefix with PREFIX.bin and PREFIX.idx"
    )


def validate_run(cfg: Config, world_size: int) -> int:
    """Checks that need the world size or the filesystem. Returns gradient accumulation steps."""
    gas = grad_accum_steps(cfg, world_size)
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
    for key, value in (
        ("logging.log_interval", cfg.logging.log_interval),
        ("checkpoint.interval", cfg.checkpoint.interval),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
    ):
        if value <= 0:
            raise ConfigError(f"{key}={value} must be a positive integer")
    if t.eval_interval < 0 or t.eval_iters < 0:
        raise ConfigError(
            "train.eval_interval and train.eval_iters must be >= 0 (0 = no evaluation)"
        )
    if cfg.logging.spike_window < 2:
        raise ConfigError(f"logging.spike_window={cfg.logging.spike_window} must be >= 2")
    validate_schedule(cfg.schedule, t.train_iters)
    return gas


def check_data_paths(cfg: Config) -> None:
    if not cfg.data.train:
        raise ConfigError(
            "data.train is empty; give at least one prepared dataset "
            "(tools/prepare_data.py --output DIR, then data.train: [DIR])"
        )
    for i, p in enumerate(cfg.data.train):
        _check_data_path(f"data.train[{i}]", p)
    for i, p in enumerate(cfg.data.valid):
        _check_data_path(f"data.valid[{i}]", p)
    if cfg.data.train_weights is not None and len(cfg.data.train_weights) != len(cfg.data.train):
        raise ConfigError(
            f"data.train_weights has {len(cfg.data.train_weights)} entries but "
            f"data.train has {len(cfg.data.train)}; give one weight per dataset"
        )


def prepare_recipe_data(cfg: Config, env: dist_utils.DistEnv) -> None:
    """Build data.train[0] with `data.recipe` (rank 0; the others wait).

    The recipe is idempotent: it returns at once when the folder is complete and finishes
    one that a killed run left half-made.
    """
    if cfg.data.recipe is None or not cfg.data.train:
        return
    target = Path(cfg.data.train[0])
    if env.is_main:
        from pretrain.data.recipes import prepare_stdlib_corpus

        if not target.exists():
            _log(env, f"preparing the {cfg.data.recipe!r} corpus in {target} (once)")
        prepare_stdlib_corpus(target)
    dist_utils.barrier()


# ----------------------------------------------------------------------------- DeepSpeed


def deepspeed_config(cfg: Config, world_size: int, device: torch.device) -> dict[str, Any]:
    t, o = cfg.train, cfg.optim
    gas = grad_accum_steps(cfg, world_size)
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                # On CPU: torch's AdamW instead of a ~70 s JIT-compiled CPU Adam; on
                # CUDA DeepSpeed's fused Adam.
                "torch_adam": device.type != "cuda",
            },
        },
        "zero_optimization": {"stage": t.zero_stage},
        "steps_per_print": 2**31 - 1,  # we log; DeepSpeed's own step lines stay quiet
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        # The paper: forward/backward in BF16, gradient accumulation and reductions in FP32.
        ds["data_types"] = {"grad_accum_dtype": t.grad_accum_dtype}
        ds["communication_data_type"] = "fp32"
    return deep_merge(ds, t.deepspeed)


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


# ----------------------------------------------------------------------------- helpers


class _StopFlag:
    """SIGTERM/SIGUSR1 only set a flag; the loop checkpoints after the current step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {}

    def _handler(self, signum, frame) -> None:
        self.signum = signum

    def install(self) -> None:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


@torch.no_grad()
def parameter_norm(model: torch.nn.Module) -> float:
    norms = [p.detach().float().norm() for p in model.parameters()]
    return float(torch.stack(norms).norm()) if norms else 0.0


def evaluate(
    model: Transformer, batches: Iterable[dict[str, torch.Tensor]], text_per_token: dict[str, float]
) -> dict[str, float]:
    """Validation loss over every rank's share of `batches`: loss, ppl, bits per token, and
    bits per byte (and per character, for character-level data) when `text_per_token` has them."""
    from pretrain.eval.metrics import evaluate_loss

    out = evaluate_loss(model, batches, **text_per_token)
    out.pop("tokens", None)
    return {f"valid/{k}": v for k, v in out.items()}


def _text_per_token(tok, valid, n: int = 256) -> dict[str, float]:
    """UTF-8 bytes (and, for a character-level tokenizer, characters) per token of the
    validation data, measured once at start for bits per byte / per character."""
    if tok is None or valid is None:
        return {}
    from pretrain.eval.metrics import bytes_per_token

    units = {"bytes_per_token": "byte"}
    if getattr(tok, "kind", None) == "chars":
        units["chars_per_token"] = "char"
    out = {}
    for key, unit in units.items():
        with contextlib.suppress(ValueError, NotImplementedError):
            out[key] = bytes_per_token(tok, (valid[i]["input_ids"] for i in range(min(n, len(valid)))), unit)
    return out


def format_tokens(n: int) -> str:
    """1_234 -> '1.23K', 100_663_296_000 -> '100.66B': a token count a person reads at a glance."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _take(it: Iterator, n: int) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def _log(env: dist_utils.DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


def _quiet_deepspeed() -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


# ----------------------------------------------------------------------------- data


class DataSource:
    """What the loop needs from the data side: datasets, a loader factory and a tokenizer."""

    def __init__(self, train, valid, make_loader, tokenizer=None):
        self.train, self.valid, self.make_loader, self.tokenizer = (
            train,
            valid,
            make_loader,
            tokenizer,
        )


def build_data(cfg: Config, valid_samples: int) -> DataSource:
    """megatron-core indexed datasets through pretrain.data (blends, split, resumable order)."""
    from pretrain.data import dataset as data

    t = cfg.train
    train, valid = data.build_datasets(
        cfg.data, cfg.seq_len, t.seed, t.train_iters * t.global_batch_size, valid_samples
    )
    return DataSource(train, valid, data.make_loader, data.tokenizer_for_data(cfg.data))


# ----------------------------------------------------------------------------- training


def train(cfg: Config, data: DataSource | None = None, save_checkpoints: bool = True) -> int:
    """Train (or resume) the run described by `cfg`. Returns EXIT_OK or EXIT_PREEMPTED.

    `data` replaces the megatron-core data pipeline (in-memory datasets for tests and the
    throughput benchmark); `save_checkpoints=False` writes none (the benchmark).
    """
    # Installed first: a pre-emption signal during start-up stops the run after its first step.
    stop = _StopFlag()
    stop.install()
    try:
        return _train(cfg, data, save_checkpoints, stop)
    finally:
        stop.restore()


def _train(cfg: Config, data: DataSource | None, save_checkpoints: bool, stop: _StopFlag) -> int:
    import deepspeed

    env = dist_utils.setup_env()
    device = dist_utils.device_for(env)
    gas = validate_run(cfg, env.world_size)
    if data is None and cfg.data.recipe is None:
        check_data_paths(cfg)  # fail before the process group and the model are built
    t = cfg.train
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    _quiet_deepspeed()
    dist_utils.init_process_group(device)

    run_dir = Path(cfg.logging.run_dir)
    ckpt_dir = checkpoints_dir(run_dir, cfg.checkpoint.dir)
    resolved = to_dict(cfg)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _warn_config_changes(run_dir, resolved, env)

    eval_on = bool(cfg.data.valid or data is not None) and t.eval_interval > 0 and t.eval_iters > 0
    valid_samples = t.eval_iters * t.global_batch_size if eval_on else 0
    if data is None:
        prepare_recipe_data(cfg, env)
        check_data_paths(cfg)
        _log(
            env,
            f"building datasets (train {t.train_iters * t.global_batch_size:,} samples "
            f"of {cfg.seq_len} tokens)",
        )
        data = build_data(cfg, valid_samples)
    tok = data.tokenizer
    if tok is not None and tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tok.vocab_size}); set model.vocab_size={tok.vocab_size}"
        )
    eval_on = eval_on and data.valid is not None
    valid_text = _text_per_token(tok, data.valid) if eval_on and env.is_main else {}

    # Same seed on every rank: identical initial weights (DeepSpeed also broadcasts them).
    torch.manual_seed(t.seed)
    with torch.device(device):  # built where it trains: an 8B model never sits in host memory
        model = Transformer(cfg.model)
    model.gradient_checkpointing = resolve_activation_checkpointing(cfg, env.world_size, device)
    ds_config = deepspeed_config(cfg, env.world_size, device)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg),
        config=ds_config,
        lr_scheduler=lambda opt: make_scheduler(opt, cfg.optim.lr, cfg.schedule, t.train_iters),
        dist_init_required=False,
    )
    if t.compile:
        engine.compile()
    module: Transformer = engine.module

    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint.keep_last, env.rank, env.world_size)
    step, consumed = 0, 0
    detector = SpikeDetector(cfg.logging.spike_window, cfg.logging.spike_threshold)
    tag = find_resume_tag(ckpt_dir) if cfg.checkpoint.resume else None
    if tag is not None:
        saved = read_state(ckpt_dir / tag).get("config", {}).get("model", {})
        changed = _diff(saved, resolved["model"], "model")
        if changed:
            raise ConfigError(
                f"{ckpt_dir / tag} holds a different model ({'; '.join(changed)}); "
                f"use a new logging.run_dir, or --set checkpoint.resume=false to "
                f"start this run over"
            )
        state = ckpt.load(engine, tag)
        step, consumed = state["step"], state["consumed_samples"]
        detector.load_state_dict(state.get("spike_detector", {}))
        if consumed % t.global_batch_size:
            raise ConfigError(
                f"checkpoint {tag} consumed {consumed} samples, not a multiple of "
                f"train.global_batch_size={t.global_batch_size}; resume with the "
                f"batch size it was trained with"
            )
        _log(env, f"resumed from {ckpt_dir / tag} (step {step}, {consumed:,} samples)")
    if env.is_main:
        _write_run_config(run_dir, resolved)
    if step >= t.train_iters:
        _log(env, f"run already finished: step {step} >= train.train_iters={t.train_iters}")
        return EXIT_OK

    tokens_per_step = t.global_batch_size * cfg.seq_len
    n_params = module.num_params()
    _log(
        env,
        f"model: {n_params / 1e6:.2f}M parameters ({module.num_params(True) / 1e6:.2f}M "
        f"without embeddings), rotary dims {cfg.model.rope_dims}/{cfg.model.head_dim}; "
        f"{env.world_size} rank(s) on {device.type}, {t.precision}, ZeRO-{t.zero_stage}; "
        f"global batch {t.global_batch_size} = {t.micro_batch_size} x {gas} accumulation "
        f"x {env.world_size} ranks; {tokens_per_step:,} tokens/step x {t.train_iters:,} steps "
        f"= {format_tokens(tokens_per_step * t.train_iters)} tokens",
    )

    monitor = Monitor(run_dir, env.is_main, cfg.logging.tensorboard, resume_step=step)
    if env.is_main and step == 0:
        monitor.text(0, "config", "```\n" + yaml.safe_dump(resolved, sort_keys=False) + "\n```")
    throughput = Throughput(
        module.flops_per_token(cfg.seq_len), cfg.logging.peak_tflops, env.world_size
    )

    def mfu_text(mfu: float) -> str:
        # The peak is a GPU's (logging.peak_tflops); measured against a CPU it means nothing.
        return f"MFU {100 * mfu:.1f}%" if device.type == "cuda" else "MFU n/a on CPU"

    loader = data.make_loader(
        data.train,
        t.global_batch_size,
        t.micro_batch_size,
        env.rank,
        env.world_size,
        consumed,
        cfg.data.num_workers,
    )
    batches = iter(loader)

    def valid_batches():
        vl = data.make_loader(
            data.valid, t.global_batch_size, t.micro_batch_size, env.rank, env.world_size, 0, 0
        )
        return _take(iter(vl), t.eval_iters * gas)

    def write_weights(folder: Path) -> None:
        save_weights(module, folder, resolved, dtype=None)
        if tok is not None:
            tok.save(folder / "tokenizer")

    def save(at_step: int) -> Path:
        state = {
            "consumed_samples": consumed,
            "consumed_tokens": consumed * cfg.seq_len,
            "data": {"consumed_samples": consumed, "train": list(cfg.data.train)},
            "spike_detector": detector.state_dict(),
            "config": resolved,
        }
        folder = ckpt.save(engine, at_step, state, write_weights)
        _log(env, f"saved checkpoint {folder}")
        return folder

    exit_code = EXIT_OK
    last_saved = step if tag is not None else None
    t_start = time.perf_counter()
    steps_timed, window_start = 0, time.perf_counter()
    try:
        while step < t.train_iters:
            sample_logits = (
                cfg.logging.max_logit_interval > 0
                and (step + 1) % cfg.logging.max_logit_interval == 0
            )
            lr_used = engine.get_lr()[0]  # the scheduler's rate for this update
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            token_sum = torch.zeros((), dtype=torch.float64, device=device)
            first = None
            for _ in range(gas):
                try:
                    batch = next(batches)
                except StopIteration:
                    raise RuntimeError(
                        f"the training data ran out at step {step + 1}; the dataset "
                        f"holds fewer than train_iters x global batch samples"
                    ) from None
                x, y = batch["input_ids"].to(device), batch["labels"].to(device)
                first = first if first is not None else x[:1]
                loss = engine(x, targets=y)
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().double()
                token_sum += x.sum(dtype=torch.float64)
            step += 1
            consumed += t.global_batch_size
            throughput.add(tokens_per_step)
            steps_timed += 1

            # One collective per step: the global mean loss, "did any rank get a signal", and
            # the sum of the step's token ids (a fingerprint that shows a resume read the
            # same data).
            flag = torch.tensor(float(stop.signum is not None), dtype=torch.float64, device=device)
            stats = dist_utils.all_reduce_sum(torch.stack([loss_sum / gas, flag, token_sum]))
            loss_value = float(stats[0]) / env.world_size
            stopping = float(stats[1]) > 0

            grad_norm = engine.get_global_grad_norm()
            scalars = {
                "train/loss": loss_value,
                "train/lr": lr_used,
                "progress/batch_token_sum": float(stats[2]),
            }
            if grad_norm is not None:
                scalars["train/grad_norm"] = float(grad_norm)
            spike = detector.update(step, loss_value)
            if spike is not None:
                _log(
                    env,
                    f"warning: loss spike at step {step}: loss {spike.loss:.4f}, expected "
                    f"{spike.expected:.4f} (robust z-score {spike.score:.1f})",
                )
                monitor.spike(spike)
            if sample_logits:
                module.set_record_max_logit(True)
                with torch.no_grad():
                    was = module.training
                    module.eval()
                    module(first)
                    module.train(was)
                module.set_record_max_logit(False)
                logits = module.max_attention_logits()
                for i, v in enumerate(logits):
                    scalars[f"stability/max_attn_logit/layer_{i:02d}"] = v
                scalars["stability/max_attn_logit"] = max(logits)
            log_now = step % cfg.logging.log_interval == 0 or step == t.train_iters or stopping
            if log_now:
                tps, mfu = throughput.read()
                dt_step = (time.perf_counter() - window_start) / max(1, steps_timed)
                steps_timed, window_start = 0, time.perf_counter()
                scalars.update(
                    {
                        "perf/tokens_per_s": tps,
                        "perf/mfu": mfu,
                        "perf/step_time_s": dt_step,
                        "perf/peak_memory_gib": peak_memory_gib(device),
                        "progress/samples": consumed,
                        "progress/tokens": consumed * cfg.seq_len,
                        "stability/param_norm": parameter_norm(module),
                    }
                )
                _log(
                    env,
                    f"step {step}/{t.train_iters} | loss {loss_value:.4f} | lr {scalars['train/lr']:.3e}"
                    f" | gnorm {scalars.get('train/grad_norm', float('nan')):.3f}"
                    f" | {tps / 1e3:,.1f}k tok/s | {mfu_text(mfu)}"
                    f" | ETA {format_eta(dt_step * (t.train_iters - step))}",
                )
            if eval_on and (step % t.eval_interval == 0 or step == t.train_iters):
                scalars.update(evaluate(module, valid_batches(), valid_text))
                bpb, bpc = scalars.get("valid/bits_per_byte"), scalars.get("valid/bits_per_char")
                _log(
                    env,
                    f"step {step} | valid loss {scalars['valid/loss']:.4f} | "
                    f"ppl {scalars['valid/ppl']:.2f} | bits/token {scalars['valid/bits_per_token']:.4f}"
                    + (f" | bits/byte {bpb:.4f}" if bpb is not None else "")
                    + (f" | bits/char {bpc:.4f}" if bpc is not None else ""),
                )
                throughput.reset()
            monitor.scalars(step, scalars)

            if save_checkpoints and (
                stopping or step % cfg.checkpoint.interval == 0 or step == t.train_iters
            ):
                save(step)
                last_saved = step
                throughput.reset()
            if stopping:
                name = (
                    signal.Signals(stop.signum).name if stop.signum else "a signal on another rank"
                )
                _log(
                    env,
                    f"received {name}: checkpoint written at step {step}; exiting with "
                    f"{EXIT_PREEMPTED} so the job can be requeued",
                )
                exit_code = EXIT_PREEMPTED
                break
    finally:
        monitor.close()

    if exit_code == EXIT_OK and env.is_main:
        elapsed = time.perf_counter() - t_start
        _log(env, f"done: {step} steps in {elapsed:.0f}s")
        if cfg.logging.sample_prompts and tok is not None:
            _print_samples(module, tok, cfg, device)
        _log(env, f"TensorBoard: tensorboard --logdir {run_dir}")
        _log(env, f"metrics:     {run_dir / 'metrics.jsonl'}")
        if last_saved is not None:
            _log(
                env, f"checkpoint:  {ckpt_dir / step_tag(last_saved)} (weights: model.safetensors)"
            )
    dist_utils.barrier()
    return exit_code


def _warn_config_changes(run_dir: Path, resolved: dict[str, Any], env: dist_utils.DistEnv) -> None:
    """On a re-run, say which settings differ from the saved RUN/config.yaml."""
    path = run_dir / RUN_CONFIG_FILE
    if path.is_file():
        changed = _diff(yaml.safe_load(path.read_text()) or {}, resolved)
        if changed:
            _log(env, "warning: config differs from the saved run config: " + ", ".join(changed))


def _write_run_config(run_dir: Path, resolved: dict[str, Any]) -> None:
    path = run_dir / RUN_CONFIG_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(resolved, sort_keys=False))
    os.replace(tmp, path)


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [f"{prefix} {a!r} -> {b!r}"]


@torch.no_grad()
def _print_samples(model: Transformer, tok, cfg: Config, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    print("samples:", flush=True)
    for prompt in cfg.logging.sample_prompts:
        ids = tok.encode(prompt)
        room = cfg.seq_len - len(ids)  # positions the model was trained on
        if not ids or room <= 0:
            continue
        out = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=min(200, room),
            temperature=0.8,
            top_k=50,
            generator=gen,
        )
        text = tok.decode(out[0].tolist())
        print("-" * 60 + "\n" + text, flush=True)
    print("-" * 60, flush=True)


__all__ = [
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "DataSource",
    "deepspeed_config",
    "grad_accum_steps",
    "check_data_paths",
    "param_groups",
    "train",
    "validate_run",
]
