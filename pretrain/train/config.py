"""The training sections: `optim:`, `schedule:`, `train:`, `checkpoint:`, `logging:`, `spikes:`
and `wandb:`. Rules across sections are pretrain/config.py's; the machine's, preflight.py's."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pretrain.schema import Bool, ConfigError, Float, Hint, Int, Seconds, Section, int_choice

SEED_LIMIT = 2**32  # NumPy's seeds (np.random.seed, megatron-core's sample order) are 32-bit


class OptimConfig(Section):
    """AdamW, as the paper (GPT-NeoX): lr 4e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1, clip 1."""

    key = "optim"

    lr: Float = Field(4e-4, gt=0)
    """peak learning rate"""
    betas: tuple[Float, Float] = (0.9, 0.95)
    """Adam betas"""
    eps: Float = 1e-8
    """Adam epsilon"""
    weight_decay: Float = 0.1
    """decoupled weight decay"""
    grad_clip: Annotated[Float, Hint("0 = no clipping")] = Field(1.0, ge=0)
    """clip the global gradient norm; 0 = off"""
    decay_norms_and_biases: Bool = False
    """apply weight decay to norm weights and biases (GPT-NeoX: no)"""
    decay_embeddings: Bool = True
    """apply weight decay to the token (and position) embeddings"""
    impl: Literal["auto", "fused", "foreach", "deepspeed"] = "auto"
    """the AdamW behind DeepSpeed: `auto` = DeepSpeed's FusedAdam on CUDA, torch's fused AdamW elsewhere (foreach where fused is missing); `fused`, `foreach`, or `deepspeed` (DeepSpeed's own: FusedAdam on CUDA, a single-tensor loop on CPU)"""


class ScheduleConfig(Section):
    """Linear warmup, then decay to min_lr_ratio x lr at train.train_iters."""

    key = "schedule"

    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """`cosine`, `linear` or `constant` after the warmup"""
    warmup_fraction: Annotated[Float | None, Hint("0.05 = 5% of train_iters")] = Field(
        0.05, ge=0, le=1
    )
    """warmup as a fraction of `train.train_iters` (rounded)"""
    warmup_steps: Annotated[Int | None, Hint("steps of warmup")] = Field(None, ge=0)
    """warmup in steps; when set it wins over `warmup_fraction`"""
    min_lr_ratio: Annotated[Float, Hint("0.1 = decay to 10% of optim.lr")] = Field(0.1, ge=0, le=1)
    """the floor reached at `train_iters`, as a fraction of `optim.lr`"""


class TrainConfig(Section):
    """The step: batch layout, precision, ZeRO, seed, evaluation cadence, compile, FP8, loss."""

    key = "train"

    train_iters: Int = Field(12000, gt=0)
    """optimizer steps"""
    global_batch_size: Int = Field(4096, gt=0)
    """sequences per step over all ranks; must equal micro_batch_size x accumulation x world size"""
    micro_batch_size: Int = Field(64, gt=0)
    """sequences per rank per forward; accumulation = global / (micro x world)"""
    seq_len: Annotated[Int | None, Hint("null = model.max_seq_len")] = Field(None, gt=0)
    """tokens per sequence; null = model.max_seq_len"""
    precision: Literal["bf16", "fp32"] = "bf16"
    """`bf16` (DeepSpeed bf16: compute in BF16, FP32 master weights) or `fp32`"""
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    """gradient accumulation dtype under bf16 (the paper: fp32 for 1B, bf16 for 8B); all-reduce is always fp32"""
    zero_stage: Annotated[
        int_choice(0, 1, 2), Hint("1 shards optimizer states, 2 also gradients")
    ] = 1
    """ZeRO stage: 1 shards optimizer states (the paper), 2 also gradients; 0 only with fp32 or bf16 accumulation"""
    seed: Annotated[Int, Hint("a seed NumPy can take")] = Field(1234, ge=0, le=SEED_LIMIT - 1)
    """model initialization and data order"""
    eval_interval: Annotated[Int, Hint("0 = no evaluation")] = Field(2000, ge=0)
    """validate every N steps (and at the end); 0 = never"""
    eval_iters: Annotated[Int, Hint("0 = no evaluation")] = Field(10, ge=0)
    """global batches of validation data per evaluation (the same samples every time)"""
    activation_checkpointing: Annotated[
        Bool | Annotated[Int, Field(ge=0)] | Literal["none", "full", "auto"],
        Hint("a number of layers, 0 to model.n_layers"),
    ] = False
    """recompute blocks in the backward pass (less memory, more FLOPs): false/`none`, true/`full`, N = the first N blocks, or `auto` = the least recompute that fits the GPU, planned at start (docs/performance.md)"""
    compile: Bool | Literal["auto"] = "auto"
    """`torch.compile` the model through DeepSpeed (`engine.compile()`, inductor). `auto`: compiled on CUDA (14-18% faster steps on an H100/H200, docs/speed.md) where the planner's compiled step fits the GPU, eager where only the eager one fits and on CPU; the run's log says which and why. `true` is refused before the run where it cannot work (no torch.compile on this Python; no C++ compiler on a machine without CUDA)"""
    compile_regions: Literal["model", "blocks"] = "model"
    """what `compile` compiles: `model` (the whole model, DeepSpeed's `engine.compile()`) or `blocks` (each block on its own, torchtitan's regional compilation: identical blocks share one compiled graph, so compiling costs about one block's time). gpu-check's compile stages time both; `model` stays the default until a GPU has measured `blocks`"""
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    """FP8 matmuls in the blocks' linear layers through torchao's float8 training (pretrain/train/fp8.py): `tensorwise` (one scale per tensor, fastest) or `rowwise` (a scale per row, more accurate); never the embedding or the output layer, and only layers whose dims are multiples of 16. Weights, checkpoints and exports stay those of a bf16 run. Needs compute capability 8.9+ (H100, H200); refused in one line elsewhere. docs/speed.md, "FP8 training" """
    fp8_emulate: Bool = False
    """torchao's emulation of `fp8` (the same casts and scales, high-precision matmuls): runs anywhere, for the fp8 numerics on CPU (the tests), not its speed"""
    z_loss: Annotated[Float, Hint("0 = off; PaLM 1e-4")] = Field(0.0, ge=0)
    """z-loss coefficient (PaLM: 1e-4): adds z_loss x mean(logsumexp(logits)^2); `train/loss` stays the cross-entropy, the added term is `train/z_loss`; 0 = off (the paper)"""
    loss_backend: Literal["chunked", "liger"] = "chunked"
    """the output layer + cross-entropy: `chunked` (any device, a chunk of tokens at a time, never the whole logits) or `liger` (liger-kernel's fused Triton kernel, CUDA only, opt-in; not traced by the planner)"""
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """extra DeepSpeed config keys merged over the generated config (advanced)"""
    hang_timeout: Annotated[Seconds | None, Hint("seconds; 0 or null = off")] = 300.0
    """the hang watchdog: seconds without a completed step before every rank writes its stacks to `RUN/hang/` and the job exits 124 (requeued by slurm/launch.sh); 9x a Llama-8B paper step; 0 or null = off (docs/hangs.md)"""
    hang_timeout_long: Annotated[Seconds | None, Hint("seconds; null = 4 x hang_timeout")] = None
    """the watchdog's allowance until the first step of a start completes and while a rank saves, loads or evaluates; null = 4 x hang_timeout; keep it below the collectives' 30-minute timeout"""
    straggler_fraction: Float = Field(0.5, gt=0)
    """a rank whose own time per step (reading its batches and its forward passes) is more than this fraction above the median rank's is slow (docs/hangs.md)"""
    straggler_steps: Int = Field(3, ge=0)
    """logged steps in a row a rank must be slow before one line names it (rank, host, the slow part); 0 = never"""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.precision == "bf16" and self.grad_accum_dtype == "fp32" and self.zero_stage == 0:
            raise ConfigError(
                "train.zero_stage=0 cannot accumulate bf16 gradients in fp32 in DeepSpeed; "
                "use train.zero_stage=1 (the paper's setting) or grad_accum_dtype=bf16"
            )
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
    interval: Int = Field(1000, gt=0)
    """save every N steps; also at the end and on SIGTERM/SIGUSR1"""
    keep_last: Int = Field(3, gt=0)
    """complete checkpoints kept; older ones are deleted"""
    resume: Bool = True
    """continue from the newest complete checkpoint when there is one"""
    verify: Literal["checksum", "size", "none"] = "checksum"
    """before resuming, check the checkpoint's files against the sizes and CRC-32s its marker recorded (`size`: sizes only; `none`: trust them); a damaged one falls back to the previous; one whose marker lists no files is used with a warning (unverified)"""
    init_from: str | None = None
    """Start a new run from another run's weights: RUN (its newest checkpoint), RUN@STEP, or a checkpoint/weights folder; fresh optimizer, schedule and data position. The model may differ in positions only."""
    async_: Bool = Field(False, alias="async")
    """copy the state to host memory at the save step and write, fsync and checksum it in the background while training goes on; `latest` moves only when every rank's files are on disk; the same files as a synchronous save (docs/checkpoints.md, "Asynchronous checkpoints"). The Python field is `async_` (`async` is a keyword); YAML and `--set checkpoint.async=true` use `async`"""


class LoggingConfig(Section):
    """The run folder, logging cadence and what is logged."""

    key = "logging"

    run_dir: str = "runs/default"
    """the run folder: config, metrics.jsonl, tensorboard/, checkpoints/"""
    log_interval: Int = Field(10, gt=0)
    """console line and throughput/memory/param-norm scalars every N steps (loss, lr and grad norm are logged every step)"""
    tensorboard: Bool = True
    """write TensorBoard event files (metrics.jsonl is always written)"""
    peak_tflops: Float = 989.0
    """peak FLOP/s per device for MFU (H200 dense BF16: 989)"""
    max_logit_interval: Annotated[Int, Hint("0 = off")] = Field(100, ge=0)
    """sample the largest attention logit per layer every N steps; 0 = off"""
    sample_prompts: list[str] = Field(default_factory=list)
    """prompts to sample continuations from when training ends"""


RANK_FAULTS = ("hang", "slow")
FaultKind = Literal["nan", "scale_loss", "scale_grads", "inf_grads", "noise", "hang", "slow"]


class FaultConfig(Section):
    """A fault injected on purpose (tests, demos) at data step `step`: a data fault corrupts
    that step's batch and travels with it (a rollback that skips the batch avoids it); a rank
    fault (hang, slow) stops or slows one rank."""

    key = "spikes.faults[]"

    step: Annotated[Int, Hint("data steps count from 1")] = Field(ge=1)
    """The data step of the fault (>= 1)."""
    last: Int | None = None
    """Data steps step..last (null = step only); not for hang."""
    kind: FaultKind = "scale_loss"
    """nan: the loss is NaN; scale_loss: the loss and its gradients x factor; scale_grads: the gradients only; inf_grads: the gradients are not finite, the loss is (an overflow); noise: random token ids (bad data); hang: rank `rank` blocks for good (once per run folder); slow: rank `rank` sleeps `seconds` before each forward."""
    factor: Float = 100.0
    """scale_loss and scale_grads: the multiplier."""
    rank: Annotated[Int | None, Hint("a rank, 0 to world size - 1")] = Field(None, ge=0)
    """hang and slow: the rank that stalls; a data fault: the one rank whose batch it corrupts (null = every rank)."""
    seconds: Annotated[Float | None, Hint("the delay per step")] = Field(
        None, gt=0, allow_inf_nan=False
    )
    """slow only: the delay per step."""

    def check(self, key: str) -> None:
        """The rules of one fault that need no world size (pretrain/config.py has the rank's)."""
        if self.last is not None and self.last < self.step:
            raise ConfigError(f"{key}.last={self.last} must be >= step={self.step}")
        if self.kind in RANK_FAULTS:
            if self.kind == "slow" and self.seconds is None:
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
            math.isfinite(self.factor) and self.factor
        ):
            raise ConfigError(f"{key}.factor={self.factor} must be finite and non-zero")


class SpikesConfig(Section):
    """Loss spikes (docs/spikes.md): always detected and logged; skipped or
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
    skip_data: Annotated[
        list[tuple[Annotated[Int, Field(ge=1)], Annotated[Int, Field(ge=1)]]],
        Hint("[first, last] data steps, 1 <= first <= last"),
    ] = Field(default_factory=list)
    """`[[first, last], ...]` data steps never trained on (inclusive), as PaLM skipped batches by hand"""
    faults: list[FaultConfig] = Field(default_factory=list)
    """faults injected on purpose, for tests and demos: `{step, last, kind, factor}`, kind `nan`, `scale_loss`, `scale_grads` or `noise` (the batch of data steps step..last on every rank); or `{step, last, kind: slow, rank, seconds}` (that rank sleeps before each of those steps) and `{step, kind: hang, rank}` (that rank blocks for good, once per run folder; needs `train.hang_timeout`) for the hang watchdog (docs/hangs.md)"""

    @model_validator(mode="after")
    def _check(self) -> SpikesConfig:
        if self.rollback_after and self.rollback_within < self.rollback_after:
            raise ConfigError(
                f"spikes.rollback_within={self.rollback_within} must be >= spikes.rollback_after="
                f"{self.rollback_after} (N flagged steps within M steps)"
            )
        for i, (first, last) in enumerate(self.skip_data):
            if first > last:
                raise ConfigError(
                    f"spikes.skip_data[{i}]=[{first}, {last}] must be [first, last] data steps "
                    f"with first <= last"
                )
        for i, f in enumerate(self.faults):
            f.check(f"spikes.faults[{i}]")
        return self


class WandbConfig(Section):
    """Log the run's scalars to Weights & Biases too (the paper's runs did); off by default.
    Needs `pip install wandb`; `mode: offline` writes locally for a later `wandb sync`."""

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
