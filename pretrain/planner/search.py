"""The plan of a run (memory, FLOPs, time) and the search for what fits: the micro batch and
the least recompute; `resolve_activation_checkpointing` and `compiled_step_fits` decide the
`auto` of recompute and compile for a program.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pretrain.config import Config, ConfigError, ModelConfig
from pretrain.data.dataset import document_lengths
from pretrain.data.documents import attended_fraction
from pretrain.model.recompute import KEY as CKPT_KEY
from pretrain.model.recompute import describe_recompute, recompute_layers
from pretrain.model.transformer import Transformer
from pretrain.planner.compiled import compiled_extra_bytes, compiles
from pretrain.planner.deepspeed_buffers import DeepSpeedMemory, deepspeed_memory
from pretrain.planner.gpus import (
    CUBLAS_WORKSPACE,
    DEFAULT_MFU,
    GPU,
    MIN_MICRO_TOKENS,
    GiB,
    default_reserve,
)
from pretrain.planner.trace import Trace, trace_step
from pretrain.train.engine import param_groups
from pretrain.train.fp8 import fp8_layer


@dataclass
class Plan:
    name: str
    gpu: GPU
    world_size: int
    target: str  # "cuda" or "cpu": which kernels the trace follows
    micro_batch: int
    grad_accum: int
    seq_len: int
    layers: int  # recomputed blocks
    n_layers: int
    optimizer: str
    static: dict[str, int]  # live between optimizer steps (and during evaluation)
    grads: int  # parameters' .grad, live during a step before its backward (accumulation > 1)
    trace: Trace
    ds: DeepSpeedMemory
    reserve: int
    model_flops: float  # per token, forward + backward
    executed_flops: float  # per token, with recompute
    tokens_per_step: int
    steps: int
    n_params: int
    notes: list[str] = field(default_factory=list)
    compiled: bool = False  # torch.compile'd (train.compile, auto resolved as training does)
    fp8_flops: float = 0.0  # model FLOPs per token in fp8 matmuls (train.fp8; 0 = off)
    compile_extra: int = 0  # what the compiled step holds over the eager trace (compiled.py)

    # memory
    @property
    def static_bytes(self) -> int:
        return sum(self.static.values())

    @property
    def train_peak(self) -> int:
        # Forward/backward with the step's gradients (if a previous micro batch made them),
        # then after the backward and in the optimizer step, when the gradients exist.
        ds = self.ds
        grads = self.ds.grads
        forward_backward = self.grads + self.trace.train + self.compile_extra + ds.backward
        return self.static_bytes + max(forward_backward, grads + ds.after_backward, grads + ds.step)

    @property
    def eval_peak(self) -> int:
        return self.static_bytes + self.trace.eval

    @property
    def probe_peak(self) -> int:
        return self.static_bytes + self.trace.probe

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.eval_peak, self.probe_peak)

    @property
    def usable(self) -> int:
        return self.gpu.memory - self.reserve

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    # time
    @property
    def recompute_ratio(self) -> float:
        return self.executed_flops / self.model_flops

    def step_time(self, mfu: float) -> float:
        """Seconds per optimizer step at `mfu` (model FLOPs / peak FLOP/s of the GPUs)."""
        return (
            self.model_flops * self.tokens_per_step / (self.world_size * self.gpu.peak_flops * mfu)
        )

    @property
    def fp8_share(self) -> float:
        """The share of the model's FLOPs that train.fp8 runs in fp8 matmuls."""
        return self.fp8_flops / self.model_flops

    def fp8_ideal_step_time(self, mfu: float) -> float:
        """step_time with the fp8 matmuls at twice bf16's rate (H100/H200: 1979 vs 989
        dense TFLOP/s) and the casts free: the bound fp8 can approach, never reach; the time
        plans keep `step_time` (gpu-check's fp8 figure says how close a GPU gets)."""
        return self.step_time(mfu) * (1 - self.fp8_share / 2)

    def run_time(self, mfu: float) -> float:
        return self.steps * self.step_time(mfu)

    def gpu_hours(self, mfu: float) -> float:
        return self.run_time(mfu) * self.world_size / 3600

    def summary(self, mfu: float = DEFAULT_MFU) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpu": self.gpu.name,
            "gpu_gib": round(self.gpu.gib, 2),
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "seq_len": self.seq_len,
            "activation_checkpointing": self.layers,
            "compiled": self.compiled,
            "compile_extra_gib": self.compile_extra / GiB,
            "checkpointing": describe_recompute(self.layers, self.n_layers),
            "optimizer": self.optimizer,
            "static_gib": self.static_bytes / GiB,
            "static": {k: v / GiB for k, v in self.static.items()},
            "grads_gib": self.ds.grads / GiB,
            "train_peak_gib": self.train_peak / GiB,
            "eval_peak_gib": self.eval_peak / GiB,
            "probe_peak_gib": self.probe_peak / GiB,
            "reserve_gib": self.reserve / GiB,
            "fits": self.fits,
            "model_flops_per_token": self.model_flops,
            "executed_flops_per_token": self.executed_flops,
            "recompute_ratio": self.recompute_ratio,
            "fp8_share": self.fp8_share,
            "fp8_ideal_step_time_s": self.fp8_ideal_step_time(mfu),
            "step_time_s_at_100pct": self.step_time(1.0),
            "step_time_s": self.step_time(mfu),
            "run_time_h_at_100pct": self.run_time(1.0) / 3600,
            "run_time_h": self.run_time(mfu) / 3600,
            "gpu_hours": self.gpu_hours(mfu),
            "mfu": mfu,
            "notes": self.notes,
        }


def _meta_model(cfg: ModelConfig):
    with torch.device("meta"):
        return Transformer(cfg)


def flops_per_token(
    cfg: ModelConfig, seq_len: int, layers: int, attended: float = 1.0
) -> tuple[float, float]:
    """(model FLOPs per token, executed FLOPs per token with `layers` blocks recomputed).

    Model: `Transformer.flops_per_token` (6 x matmul weights + attention, PaLM's count).
    A recomputed block runs its forward once more: 2 x its matmul weights + 4 x n_heads x
    head_dim x seq_len (QK^T and AV) per token. `attended`: the share of causal attention
    pairs a document mask keeps (data/documents.attended_fraction); executed attention counts
    only those, the model FLOPs (MFU's numerator) keep the usual causal count. Sliding-window
    layers count the pairs their window attends in both (`Transformer.attention_shares`; with
    a document mask too, the two shares are multiplied: an estimate).
    """
    model = _meta_model(cfg)
    model_flops = model.flops_per_token(seq_len)
    shares = model.attention_shares(seq_len)
    per_layer = 12 * cfg.n_heads * cfg.head_dim * seq_len  # a full layer's, per token
    attention = per_layer * sum(shares)
    block = sum(
        m.weight.numel() for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)
    )
    per_block = 2 * block + 4 * cfg.n_heads * cfg.head_dim * seq_len * attended
    if all(share == 1 for share in shares[:layers]):
        recomputed = layers * per_block
    else:
        recomputed = sum(per_block + (per_block - 2 * block) * (s - 1) for s in shares[:layers])
    return model_flops, model_flops - attention * (1 - attended) + recomputed


_fractions: dict[tuple[tuple[str, ...], int], tuple[float, int] | None] = {}


def document_fraction(cfg: Config) -> tuple[float, str | None]:
    """(share of causal attention pairs kept, a note) for the run's document mask: measured on
    the first documents of data.train where they are on this machine, else 1 (an upper
    bound: every row one document)."""
    if not cfg.data.document_mask:
        return 1.0, None

    key = (tuple(cfg.data.train), cfg.seq_len)
    if key not in _fractions:
        try:
            lengths = document_lengths(list(cfg.data.train))
            _fractions[key] = (attended_fraction(lengths, cfg.seq_len), len(lengths))
        except (OSError, ValueError):  # not prepared here (a planning machine)
            _fractions[key] = None
    found = _fractions[key]
    if found is None:
        return 1.0, (
            "document mask: data.train is not on this machine, so executed attention FLOPs "
            "are counted as if every row were one document (an upper bound); plan with "
            "--set data.train=[PREFIX] to count the pairs of real documents"
        )
    fraction, docs = found
    return fraction, (
        f"document mask: {100 * fraction:.1f}% of causal attention pairs attended (the first "
        f"{docs:,} documents of data.train, packed into rows of {cfg.seq_len}); executed "
        f"FLOPs count those"
    )


def document_buffers(cfg: Config, micro_batch: int, target: str) -> dict[str, int]:
    """Bytes the document switches add per micro batch, beside the traced step: the mask
    (FlexAttention's BlockMask on CUDA: 4 int32 tile tables of (B, T/128, T/128); the boolean
    (B, T, T) mask elsewhere) and, with position reset, the per-token cos/sin (B, T, r) fp32."""
    out = {}
    # every distinct RoPE setting of the layers has its own per-token cos/sin
    T, r = cfg.seq_len, sum(c.rotary_dims for c in _meta_model(cfg.model).rope.caches)
    if cfg.data.document_mask:
        tiles = -(-T // 128)
        if target == "cuda":
            out["document mask (BlockMask tiles)"] = 4 * micro_batch * tiles * tiles * 4
        else:
            out["document mask (B x T x T)"] = micro_batch * T * T
    if cfg.data.position_reset and r:
        out["per-token RoPE cos/sin"] = 2 * micro_batch * T * r * 4
    return out


def fp8_flops_per_token(cfg: Config) -> float:
    """Model FLOPs per token (forward + backward: 6 per weight) of the layers train.fp8
    converts (pretrain/train/fp8.py fp8_layer); 0 with fp8 off."""
    if cfg.train.fp8 == "off":
        return 0.0
    model = _meta_model(cfg.model)
    return 6.0 * sum(m.weight.numel() for n, m in model.named_modules() if fp8_layer(m, n))


def _param_groups(cfg: Config) -> list[list[int]]:
    model = _meta_model(cfg.model)
    return [[p.numel() for p in g["params"]] for g in param_groups(model, cfg)]


def plan_run(
    cfg: Config,
    gpu: GPU,
    world_size: int,
    micro_batch: int | None = None,
    layers: int | None = None,
    target: str = "cuda",
    reserve: int | None = None,
    name: str = "",
    whole_logits: bool = False,
    compiled: bool | None = None,
) -> Plan:
    """The plan of `cfg` on `world_size` GPUs (micro batch and recomputed layers as given,
    else the config's; the config's "auto" must be resolved first: `choose`).
    `whole_logits`: plan the loss as it was before the chunked one (for comparisons).
    `compiled`: plan the step compiled or eager; None = as the config's train.compile."""
    t = cfg.train
    mb = micro_batch or t.micro_batch_size
    per_rank = t.global_batch_size // world_size
    if t.global_batch_size % world_size or per_rank % mb:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro batch {mb} x "
            f"{world_size} GPUs; choose a micro batch that divides {per_rank}"
        )
    L = cfg.model.n_layers
    if layers is None:
        layers = recompute_layers(t.activation_checkpointing, L)
        if layers is None:
            raise ConfigError(f"{CKPT_KEY}='auto': use choose() to pick the layers")
    seq = cfg.seq_len
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    gas = per_rank // mb
    trace = trace_step(cfg.model, mb, seq, dtype, layers, target, gas > 1, whole_logits, t.fp8)
    groups = _param_groups(cfg)
    fused = target == "cuda"
    ds = deepspeed_memory(
        groups, world_size, t.precision, t.grad_accum_dtype, t.zero_stage, fused, t.deepspeed
    )
    static = dict(ds.static)
    meta = _meta_model(cfg.model)
    static["RoPE cos/sin cache"] = meta.rope.cache_bytes()
    # a pair selection's masks (model.rope_pairs), one per layer, on the device once
    static["RoPE pair masks"] = sum(b.attn.pairs.nbytes for b in meta.blocks if b.attn.pairs)
    if target == "cuda":
        static["cuBLAS workspaces"] = CUBLAS_WORKSPACE
    static.update(document_buffers(cfg, mb, target))
    static = {k: v for k, v in static.items() if v}
    attended, documents_note = document_fraction(cfg)
    model_flops, executed = flops_per_token(cfg.model, seq, layers, attended)
    notes = [documents_note] if documents_note else []
    if t.zero_stage == 2:
        notes.append("ZeRO-2: DeepSpeed's buffers are estimated from its source, not validated")
    plan = Plan(
        fp8_flops=fp8_flops_per_token(cfg),
        name=name,
        gpu=gpu,
        world_size=world_size,
        target=target,
        micro_batch=mb,
        grad_accum=gas,
        seq_len=seq,
        layers=layers,
        n_layers=L,
        optimizer=ds.optimizer,
        static=static,
        grads=ds.grads if gas > 1 else 0,
        trace=trace,
        ds=ds,
        reserve=default_reserve(gpu.memory) if reserve is None else reserve,
        model_flops=model_flops,
        executed_flops=executed,
        tokens_per_step=t.global_batch_size * seq,
        steps=t.train_iters,
        n_params=sum(sum(g) for g in groups),
        notes=notes,
    )
    return with_compile(plan, cfg, compiled)


def with_compile(plan: Plan, cfg: Config, compiled: bool | None = None) -> Plan:
    """`plan` as the run compiles: `compiled` given, else the config's train.compile, whose
    `auto` compiles on CUDA where the compiled step fits and stays eager where only the eager
    one does, as training decides (pretrain/train/engine.py resolve_compile)."""
    if compiled is None:
        compiled = compiles(cfg, plan.target)
    extra = compiled_extra_bytes(cfg, plan.micro_batch, plan.layers, plan.target)
    as_compiled = replace(plan, compiled=True, compile_extra=extra)
    if compiled is not None:
        return as_compiled if compiled else plan
    if as_compiled.fits or not plan.fits:
        return as_compiled
    note = (
        f"train.compile=auto: eager; compiled it would need {extra / GiB:.2f} GiB more and "
        f"not fit (pretrain/planner/compiled.py)"
    )
    return replace(plan, notes=[*plan.notes, note])


def compiled_step_fits(cfg: Config, world_size: int, device: torch.device, layers: int) -> bool:
    """`train.compile: auto` at the start of a run: does the compiled step fit this GPU?"""
    gpu = device_gpu(device)
    return plan_run(cfg, gpu, world_size, layers=layers, target="cuda", compiled=True).fits


def micro_batch_on(cfg: Config, world_size: int) -> tuple[int, str | None]:
    """The micro batch `cfg` is planned at on `world_size` GPUs, and why it is not the config's
    (None where it is): the config's where it divides the sequences each GPU gets of the
    global batch, else the largest micro batch under it that does (fewer sequences than the
    config's micro batch: all of them). The one rule of `tools/plan.py CONFIG --gpus N` and
    `--scaling`. ConfigError where the global batch cannot be split over the GPUs."""
    t = cfg.train
    gbs, mb = t.global_batch_size, t.micro_batch_size
    per_gpu, left = divmod(gbs, world_size)
    if per_gpu == 0 or left:
        raise ConfigError(
            f"train.global_batch_size={gbs} is not divisible by {world_size} GPUs (each GPU "
            f"takes whole sequences); choose a GPU count that divides {gbs}"
        )
    micro = min(mb, per_gpu)
    while per_gpu % micro:
        micro -= 1
    if micro == mb:
        return mb, None
    share = f"each GPU gets {per_gpu} sequences of the global batch {gbs} ({gbs} / {world_size})"
    why = (
        f"{share}, fewer than the config's micro batch {mb}"
        if per_gpu < mb
        else f"{share}, not a multiple of the config's micro batch {mb}; {micro} is the largest "
        f"micro batch under it that divides {per_gpu}"
    )
    return micro, (
        f"micro batch shrunk from {mb} to {micro} on {world_size} GPUs: {why} (to train so: "
        f"--set train.micro_batch_size={micro})"
    )


def with_micro_batch(cfg: Config, micro_batch: int) -> Config:
    t = cfg.train.model_copy(update={"micro_batch_size": micro_batch})
    return cfg.model_copy(update={"train": t})


def micro_batch_candidates(cfg: Config, world_size: int, largest: int | None = None) -> list[int]:
    """Micro batches that keep the global batch (divisors of its per-GPU share), largest
    first, down to MIN_MICRO_TOKENS tokens (matmuls stay large) and no larger than `largest`."""
    per_rank = cfg.train.global_batch_size // world_size
    seq = cfg.seq_len
    out = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
    if largest is not None:
        out = [m for m in out if m <= largest]
    keep = [m for m in out if m * seq >= MIN_MICRO_TOKENS]
    return keep or out[:1]


def least_recompute(
    cfg: Config,
    gpu: GPU,
    world_size: int,
    micro_batch: int,
    target: str = "cuda",
    reserve: int | None = None,
    name: str = "",
    at_most: int | None = None,
) -> Plan | None:
    """The plan with the fewest recomputed blocks (at most `at_most`) that fits at this
    micro batch; None if none does. Peak memory falls as more blocks recompute, so a
    binary search over the number of blocks finds it."""
    hi = cfg.model.n_layers if at_most is None else at_most

    def make(n: int) -> Plan:
        return plan_run(cfg, gpu, world_size, micro_batch, n, target, reserve, name)

    none = make(0)
    if none.fits or hi == 0:
        return none if none.fits else None
    best = make(hi)
    if not best.fits:
        return None
    lo = 1  # invariant: make(lo - 1) does not fit, make(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        p = make(mid)
        if p.fits:
            hi, best = mid, p
        else:
            lo = mid + 1
    return best


def choose(
    cfg: Config,
    gpu: GPU,
    world_size: int,
    change_micro_batch: bool = True,
    target: str = "cuda",
    reserve: int | None = None,
    name: str = "",
) -> Plan | None:
    """The least recompute that fits: over the micro batches that keep the global batch
    (when `change_micro_batch`, else the config's), the plan with the fewest executed FLOPs;
    ties go to the larger micro batch. None when nothing fits."""
    mbs = (
        micro_batch_candidates(cfg, world_size, cfg.train.micro_batch_size)
        if change_micro_batch
        else [cfg.train.micro_batch_size]
    )
    best: Plan | None = None
    for mb in mbs:  # largest first; a smaller micro batch never needs more recompute
        at_most = best.layers - 1 if best is not None else None
        if at_most is not None and at_most < 0:
            break
        p = least_recompute(cfg, gpu, world_size, mb, target, reserve, name, at_most)
        if p is not None and (best is None or p.executed_flops < best.executed_flops):
            best = p
    return best


def largest_micro_batch(
    cfg: Config,
    gpu: GPU,
    world_size: int,
    layers: int,
    target: str = "cuda",
    reserve: int | None = None,
) -> int | None:
    """The largest micro batch (a divisor of the per-GPU batch) that fits with `layers`."""
    per_rank = cfg.train.global_batch_size // world_size
    cands = sorted(m for m in range(1, per_rank + 1) if per_rank % m == 0)
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:  # peak grows with the micro batch
        mid = (lo + hi) // 2
        if plan_run(cfg, gpu, world_size, cands[mid], layers, target, reserve).fits:
            best, lo = cands[mid], mid + 1
        else:
            hi = mid - 1
    return best


# ----------------------------------------------------------------------------- for training


def device_gpu(device: torch.device) -> GPU:
    """The GPU (or the host, for CPU runs) a program runs on, as the planner sees it."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return GPU(props.name, props.total_memory, 989e12)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return GPU("CPU (host memory)", memory, 1e12)


def resolve_activation_checkpointing(cfg: Config, world_size: int, device: torch.device) -> int:
    """The number of blocks to recompute for this run; "auto" plans it for this device
    (at the configured micro batch) and says so on rank 0."""
    L = cfg.model.n_layers
    layers = recompute_layers(cfg.train.activation_checkpointing, L)
    if layers is not None:
        return layers
    gpu, target = device_gpu(device), "cuda" if device.type == "cuda" else "cpu"
    plan = choose(cfg, gpu, world_size, change_micro_batch=False, target=target)
    if plan is None:
        raise ConfigError(
            f"{CKPT_KEY}='auto': micro batch {cfg.train.micro_batch_size} does not fit "
            f"{gpu.name} ({gpu.gib:.1f} GiB) even with every block recomputed; lower "
            f"train.micro_batch_size (tools/plan.py CONFIG --gpu ... shows what fits)"
        )
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        print(
            f"activation checkpointing auto: {describe_recompute(plan.layers, L)} "
            f"(planned peak {plan.peak / GiB:.1f} GiB of {gpu.gib:.1f} GiB on {gpu.name})",
            flush=True,
        )
    return plan.layers
