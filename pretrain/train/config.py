"""The training sections: `optim:`, `schedule:`, `train:`, `checkpoint:`, `logging:`, `spikes:`
and `wandb:`. Each section's rules are its own validators; the rules across sections are
pretrain/config.py's, and what needs this machine (a GPU for fp8, a compiler, paths) is
pretrain/preflight.py's."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pretrain.schema import Bool, ConfigError, Float, Int, Section

SEED_LIMIT = 2**32  # NumPy's seeds (np.random.seed, megatron-core's sample order) are 32-bit


class OptimConfig(Section):
    """AdamW, as the paper (GPT-NeoX): lr 4e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1, clip 1."""

    key = "optim"

    lr: Float = 4e-4
    """peak learning rate"""
    betas: tuple[Float, Float] = (0.9, 0.95)
    """Adam betas"""
    eps: Float = 1e-8
    """Adam epsilon"""
    weight_decay: Float = 0.1
    """decoupled weight decay"""
    grad_clip: Float = 1.0
    """clip the global gradient norm; 0 = off"""
    decay_norms_and_biases: Bool = False
    """apply weight decay to norm weights and biases (GPT-NeoX: no)"""
    decay_embeddings: Bool = True
    """apply weight decay to the token (and position) embeddings"""
    impl: Literal["auto", "fused", "foreach", "deepspeed"] = "auto"
    """the AdamW behind DeepSpeed: `auto` = DeepSpeed's FusedAdam on CUDA, torch's fused AdamW elsewhere (foreach where fused is missing); `fused`, `foreach`, or `deepspeed` (the old single-tensor path on CPU)"""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 = no clipping)")
        return self


class ScheduleConfig(Section):
    """Linear warmup, then decay to min_lr_ratio x lr at train.train_iters."""

    key = "schedule"

    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """`cosine`, `linear` or `constant` after the warmup"""
    warmup_fraction: Float | None = 0.05
    """warmup as a fraction of `train.train_iters` (rounded)"""
    warmup_steps: Int | None = None
    """warmup in steps; when set it wins over `warmup_fraction`"""
    min_lr_ratio: Float = 0.1
    """the floor reached at `train_iters`, as a fraction of `optim.lr`"""

    @model_validator(mode="after")
    def _check(self) -> ScheduleConfig:
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(
                f"schedule.warmup_steps={self.warmup_steps} must be >= 0 (steps of warmup)"
            )
        if self.warmup_steps is None and not 0.0 <= (self.warmup_fraction or 0.0) <= 1.0:
            raise ConfigError(
                f"schedule.warmup_fraction={self.warmup_fraction} must be in [0, 1] "
                f"(0.05 = 5% of train_iters)"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] "
                f"(0.1 = decay to 10% of optim.lr)"
            )
        return self


class TrainConfig(Section):
    """The step: batch layout, precision, ZeRO, seed, evaluation cadence, compile, FP8, loss."""

    key = "train"

    train_iters: Int = 12000
    """optimizer steps"""
    global_batch_size: Int = 4096
    """sequences per step over all ranks; must equal micro_batch_size x accumulation x world size"""
    micro_batch_size: Int = 64
    """sequences per rank per forward; accumulation = global / (micro x world)"""
    seq_len: Int | None = None
    """tokens per sequence; null = model.max_seq_len"""
    precision: Literal["bf16", "fp32"] = "bf16"
    """`bf16` (DeepSpeed bf16: compute in BF16, FP32 master weights) or `fp32`"""
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    """gradient accumulation dtype under bf16 (the paper: fp32 for 1B, bf16 for 8B); all-reduce is always fp32"""
    zero_stage: Int = 1
    """ZeRO stage: 1 shards optimizer states (the paper), 2 also gradients; 0 only with fp32 or bf16 accumulation"""
    seed: Int = 1234
    """model initialization and data order"""
    eval_interval: Int = 2000
    """validate every N steps (and at the end); 0 = never"""
    eval_iters: Int = 10
    """global batches of validation data per evaluation (the same samples every time)"""
    activation_checkpointing: Bool | Int | Literal["none", "full", "auto"] = False
    """recompute blocks in the backward pass (less memory, more FLOPs): false/`none`, true/`full`, N = the first N blocks, or `auto` = the least recompute that fits the GPU, planned at start (docs/performance.md)"""
    compile: Bool | Literal["auto"] = "auto"
    """`torch.compile` the model through DeepSpeed (`engine.compile()`, inductor). `auto`: compiled on CUDA (14-18% faster steps on an H100/H200, docs/performance.md) where the planner's compiled step fits the GPU, eager where only the eager one fits and on CPU; the run's log says which and why. `true` is refused before the run where it cannot work (no torch.compile on this Python; no C++ compiler on a machine without CUDA)"""
    compile_regions: Literal["model", "blocks"] = "model"
    """what `compile` compiles: `model` (the whole model, DeepSpeed's `engine.compile()`) or `blocks` (each block on its own, torchtitan's regional compilation: identical blocks share one compiled graph, so compiling costs about one block's time). gpu-check's compile stages time both; `model` stays the default until a GPU has measured `blocks`"""
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    """FP8 matmuls in the blocks' linear layers through torchao's float8 training (pretrain/train/fp8.py): `tensorwise` (one scale per tensor, fastest) or `rowwise` (a scale per row, more accurate); never the embedding or the output layer, and only layers whose dims are multiples of 16. Weights, checkpoints and exports stay those of a bf16 run. Needs compute capability 8.9+ (H100, H200); refused in one line elsewhere. docs/performance.md, "FP8 training" """
    fp8_emulate: Bool = False
    """torchao's emulation of `fp8` (the same casts and scales, high-precision matmuls): runs anywhere, for the fp8 numerics on CPU (the tests), not its speed"""
    z_loss: Float = 0.0
    """z-loss coefficient (PaLM: 1e-4): adds z_loss x mean(logsumexp(logits)^2); `train/loss` stays the cross-entropy, the added term is `train/z_loss`; 0 = off (the paper)"""
    loss_backend: Literal["chunked", "liger"] = "chunked"
    """the output layer + cross-entropy: `chunked` (any device, a chunk of tokens at a time, never the whole logits) or `liger` (liger-kernel's fused Triton kernel, CUDA only, opt-in; not traced by the planner)"""
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """extra DeepSpeed config keys merged over the generated config (advanced)"""
    hang_timeout: Float | None = 300.0
    """the hang watchdog: seconds without a completed step before every rank writes its stacks to `RUN/hang/` and the job exits 124 (requeued by slurm/launch.sh); 9x a Llama-8B paper step; 0 or null = off (docs/training.md, "Hangs and stragglers")"""
    hang_timeout_long: Float | None = None
    """the watchdog's allowance until the first step of a start completes and while a rank saves, loads or evaluates; null = 4 x hang_timeout; keep it below the collectives' 30-minute timeout"""
    straggler_fraction: Float = Field(0.5, gt=0)
    """a rank whose own time per step (reading its batches and its forward passes) is more than this fraction above the median rank's is slow (docs/training.md, "Hangs and stragglers")"""
    straggler_steps: Int = Field(3, ge=0)
    """logged steps in a row a rank must be slow before one line names it (rank, host, the slow part); 0 = never"""

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int) -> int:
        if not 0 <= seed < SEED_LIMIT:
            raise ConfigError(
                f"train.seed={seed} is not a seed NumPy can take; use an integer from 0 to "
                f"{SEED_LIMIT - 1}"
            )
        return seed

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        for name in ("global_batch_size", "micro_batch_size", "train_iters"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be a positive integer")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ConfigError(f"train.seq_len={self.seq_len} must be a positive integer, or null")
        if self.zero_stage not in (0, 1, 2):
            raise ConfigError(
                f"train.zero_stage={self.zero_stage} is not supported; use 0, 1 or 2 "
                f"(1 shards optimizer states, 2 also gradients)"
            )
        if self.precision == "bf16" and self.grad_accum_dtype == "fp32" and self.zero_stage == 0:
            raise ConfigError(
                "train.zero_stage=0 cannot accumulate bf16 gradients in fp32 in DeepSpeed; "
                "use train.zero_stage=1 (the paper's setting) or grad_accum_dtype=bf16"
            )
        if self.eval_interval < 0 or self.eval_iters < 0:
            raise ConfigError(
                "train.eval_interval and train.eval_iters must be >= 0 (0 = no evaluation)"
            )
        if self.z_loss < 0:
            raise ConfigError(f"train.z_loss={self.z_loss} must be >= 0 (0 = off; PaLM 1e-4)")
        for key in ("hang_timeout", "hang_timeout_long"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < math.inf:
                raise ConfigError(f"train.{key}={value} must be >= 0 seconds (0 or null = off)")
        long = self.hang_timeout_long
        if self.hang_timeout and long is not None and long < self.hang_timeout:
            raise ConfigError(
                f"train.hang_timeout_long={long} must be >= train.hang_timeout="
                f"{self.hang_timeout} (it is the allowance of the slow phases: start, saves, "
                f"evaluations); null = 4 x hang_timeout"
            )
        return self


class CheckpointConfig(Section):
    """Saving, resuming and starting from another run's weights."""

    key = "checkpoint"

    dir: str | None = None
    """null = RUN/checkpoints"""
    interval: Int = 1000
    """save every N steps; also at the end and on SIGTERM/SIGUSR1"""
    keep_last: Int = 3
    """complete checkpoints kept; older ones are deleted"""
    resume: Bool = True
    """continue from the newest complete checkpoint when there is one"""
    verify: Literal["checksum", "size", "none"] = "checksum"
    """before resuming, check the checkpoint's files against the sizes and CRC-32s its marker recorded (`size`: sizes only; `none`: trust them); a damaged one falls back to the previous; one whose marker lists no files (older code) is used with a warning (unverified)"""
    init_from: str | None = None
    """Start a new run from another run's weights: RUN (its newest checkpoint), RUN@STEP, or a checkpoint/weights folder; fresh optimizer, schedule and data position. The model may differ in positions only."""
    async_: Bool = Field(False, alias="async")
    """copy the state to host memory at the save step and write, fsync and checksum it in the background while training goes on; `latest` moves only when every rank's files are on disk; the same files as a synchronous save (docs/training.md, "Asynchronous checkpoints"). The Python field is `async_` (`async` is a keyword); YAML and `--set checkpoint.async=true` use `async`"""

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        for key in ("interval", "keep_last"):
            if getattr(self, key) <= 0:
                raise ConfigError(
                    f"checkpoint.{key}={getattr(self, key)} must be a positive integer"
                )
        return self


class LoggingConfig(Section):
    """The run folder, logging cadence and what is logged."""

    key = "logging"

    run_dir: str = "runs/default"
    """the run folder: config, metrics.jsonl, tensorboard/, checkpoints/"""
    log_interval: Int = 10
    """console line and throughput/memory/param-norm scalars every N steps (loss, lr and grad norm are logged every step)"""
    tensorboard: Bool = True
    """write TensorBoard event files (metrics.jsonl is always written)"""
    peak_tflops: Float = 989.0
    """peak FLOP/s per device for MFU (H200 dense BF16: 989)"""
    max_logit_interval: Int = 100
    """sample the largest attention logit per layer every N steps; 0 = off"""
    sample_prompts: list[str] = Field(default_factory=list)
    """prompts to sample continuations from when training ends"""

    @model_validator(mode="after")
    def _check(self) -> LoggingConfig:
        if self.log_interval <= 0:
            raise ConfigError(
                f"logging.log_interval={self.log_interval} must be a positive integer"
            )
        if self.max_logit_interval < 0:
            raise ConfigError(
                f"logging.max_logit_interval={self.max_logit_interval} must be >= 0 (0 = off)"
            )
        return self


RANK_FAULTS = ("hang", "slow")


class FaultConfig(Section):
    """A fault injected on purpose (tests and demos of `spikes` and of the hang watchdog), at
    data step `step`, the step that reads it when no data is skipped. A data fault corrupts
    that step's batch on every rank; it travels with the batch, like bad data: a rollback
    that skips the batch avoids it. A rank fault (hang, slow) stops or slows one rank."""

    key = "spikes.faults[]"

    step: Int
    """The data step of the fault (>= 1)."""
    last: Int | None = None
    """Data steps step..last (null = step only); not for hang."""
    kind: Literal["nan", "scale_loss", "scale_grads", "inf_grads", "noise", "hang", "slow"] = (
        "scale_loss"
    )
    """nan: the loss is NaN; scale_loss: the loss and its gradients x factor; scale_grads: the gradients only; inf_grads: the gradients are not finite, the loss is (an overflow); noise: random token ids (bad data); hang: rank `rank` blocks for good (once per run folder); slow: rank `rank` sleeps `seconds` before each forward."""
    factor: Float = 100.0
    """scale_loss and scale_grads: the multiplier."""
    rank: Int | None = None
    """hang and slow: the rank that stalls; a data fault: the one rank whose batch it corrupts (null = every rank)."""
    seconds: Float | None = None
    """slow only: the delay per step."""

    def check(self, key: str) -> None:
        """The rules of one fault that need no world size (pretrain/config.py has the rank's)."""
        if self.step < 1:
            raise ConfigError(f"{key}.step={self.step} must be >= 1")
        if self.last is not None and self.last < self.step:
            raise ConfigError(f"{key}.last={self.last} must be >= step={self.step}")
        if self.kind in RANK_FAULTS:
            if self.kind == "slow" and not (
                self.seconds is not None and 0 < self.seconds < math.inf
            ):
                raise ConfigError(
                    f"{key}.seconds={self.seconds}: a slow fault needs the delay per step in "
                    f"seconds (> 0)"
                )
            if self.kind == "hang" and (self.seconds is not None or self.last is not None):
                raise ConfigError(
                    f"{key}: a hang fault blocks for good at its step; remove seconds and last"
                )
        elif self.seconds is not None:
            raise ConfigError(
                f"{key}: seconds is for kind slow; remove it from a {self.kind} fault"
            )
        elif self.kind not in ("nan", "inf_grads") and not (
            math.isfinite(self.factor) and self.factor != 0
        ):
            raise ConfigError(f"{key}.factor={self.factor} must be finite and non-zero")


class SpikesConfig(Section):
    """Loss spikes (docs/training.md, "Loss spikes"): always detected and logged; skipped or
    rolled back only when asked (the paper's runs did neither)."""

    key = "spikes"

    window: Int = Field(100, ge=2)
    """steps in the rolling window of the detector (loss and grad norm each)"""
    threshold: Float = Field(6.0, gt=0)
    """robust z-score `(x - median) / (1.4826 x MAD)` above which a loss is a spike; NaN/Inf always is"""
    grad_norm_threshold: Float = Field(10.0, gt=0)
    """the same for the grad norm (before clipping): grad norms are heavy-tailed: on clean quickstart data most outliers score 6-8, a few 10-15"""
    skip_step: Bool = False
    """a flagged step applies no update: parameters, optimizer moments and step count untouched; the LR schedule and the data move on"""
    rollback_after: Int = Field(0, ge=0)
    """roll back when this many of the last `rollback_within` steps were flagged; 0 = never"""
    rollback_within: Int = 10
    """the window of that rule, in steps"""
    rollback_skip_before: Int = Field(0, ge=0)
    """data steps before the first flagged one that the rollback also skips"""
    rollback_skip_after: Int = Field(0, ge=0)
    """data steps after the rollback's own step that it also skips"""
    max_rollbacks: Int = Field(5, ge=0)
    """at most this many rollbacks in a run (then a warning, and only skips)"""
    skip_data: list[tuple[Int, Int]] = Field(default_factory=list)
    """`[[first, last], ...]` data steps never trained on (inclusive), as PaLM skipped batches by hand"""
    faults: list[FaultConfig] = Field(default_factory=list)
    """faults injected on purpose, for tests and demos: `{step, last, kind, factor}`, kind `nan`, `scale_loss`, `scale_grads` or `noise` (the batch of data steps step..last on every rank); or `{step, last, kind: slow, rank, seconds}` (that rank sleeps before each of those steps) and `{step, kind: hang, rank}` (that rank blocks for good, once per run folder; needs `train.hang_timeout`) for the hang watchdog (docs/training.md, "Hangs and stragglers")"""

    @model_validator(mode="after")
    def _check(self) -> SpikesConfig:
        if self.rollback_after and self.rollback_within < self.rollback_after:
            raise ConfigError(
                f"spikes.rollback_within={self.rollback_within} must be >= spikes.rollback_after="
                f"{self.rollback_after} (N flagged steps within M steps)"
            )
        for i, (first, last) in enumerate(self.skip_data):
            if not 1 <= first <= last:
                raise ConfigError(
                    f"spikes.skip_data[{i}]=[{first}, {last}] must be [first, last] data steps "
                    f"with 1 <= first <= last"
                )
        for i, f in enumerate(self.faults):
            f.check(f"spikes.faults[{i}]")
        return self


class WandbConfig(Section):
    """Log the run's scalars to Weights & Biases too (the paper's runs did); off by default.
    Needs `pip install wandb`; WANDB_MODE=offline (or mode: offline) writes locally for a
    later `wandb sync`."""

    key = "wandb"

    enabled: Bool = False
    """log every scalar to W&B as well"""
    project: str = "pretrain"
    """W&B project"""
    entity: str | None = None
    """W&B team or user (null = your default)"""
    name: str | None = None
    """run name (null = the run folder's name)"""
    group: str | None = None
    """W&B group, e.g. the seeds of one setting"""
    tags: list[str] = Field(default_factory=list)
    """W&B tags"""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (files under RUN/wandb/, `wandb sync` later) or disabled; null = `WANDB_MODE`, else online"""


__all__ = [
    "RANK_FAULTS",
    "SEED_LIMIT",
    "CheckpointConfig",
    "FaultConfig",
    "LoggingConfig",
    "OptimConfig",
    "ScheduleConfig",
    "SpikesConfig",
    "TrainConfig",
    "WandbConfig",
]
