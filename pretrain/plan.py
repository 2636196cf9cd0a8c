"""Memory and FLOP plan of a training run: will it fit, with what, and how long will it take.

    python tools/plan.py configs/paper/llama1b_rope10.yaml --gpu h200 --gpus 32
    python tools/plan.py CONFIG --gpu h100 --checkpointing auto     # least recompute that fits
    python tools/plan.py --validate                                  # predicted vs CPU allocator

How the memory is found (no GPU needed):

1. The model's step is *traced*: the real model code runs on fake tensors
   (`torch._subclasses.FakeTensorMode`: shapes, dtypes and storages, no data), in bf16 as
   DeepSpeed runs it, and a `TorchDispatchMode` does live-tensor accounting: every storage
   an operator creates is added when it appears and subtracted when it dies (a weak
   reference on the storage), so the running maximum is the peak of what the step keeps
   alive. One trace per phase: forward + backward of a micro batch (with the chosen
   activation checkpointing and the chunked loss), the evaluation forward (no gradients)
   and the max-logit probe.
2. On a GPU, attention runs FlashAttention-2 (`F.scaled_dot_product_attention` on Hopper),
   whose kernels allocate inside the operator; for a GPU plan the trace replaces SDPA by a
   stand-in with FlashAttention-2's allocations (torch's flash_api.cpp): the output and an
   fp32 log-sum-exp saved for the backward; in the backward dq/dk/dv, an fp32 dq
   accumulator (B, T, H, D), the fp32 softmax row sums, and with GQA the expanded dk/dv
   (B, T, H, D) before they are summed over each group.
3. DeepSpeed's own buffers are added from its source (deepspeed 0.19, see
   `deepspeed_memory`): for BF16 with FP32 gradient accumulation at ZeRO-1 (the paper's
   1B runs) `BF16_Optimizer` keeps the flat bf16 parameters, each parameter's bf16
   gradient (zeroed, never freed, between steps: `immediate_grad_update` is off), a
   *full* fp32 gradient buffer (`fp32_groups_gradients_flat`), and the rank's 1/N of fp32
   master weights and Adam's two moments; after each backward it adds every bf16 gradient
   into the fp32 buffer through an fp32 copy of that gradient. With BF16 accumulation
   (8B) `DeepSpeedZeroOptimizer` keeps bf16 gradients and allocates a contiguous reduce
   bucket of `reduce_bucket_size` (5e8) elements in every backward.
4. Peak = state between steps + the largest transient (forward/backward, after backward,
   optimizer step). A GPU "fits" when peak + reserve <= its memory; the reserve (2 GiB +
   5% of the GPU) covers what torch's allocator does not count (CUDA context, NCCL's
   buffers) and the caching allocator's fragmentation.

Checked on CPU: `validate()` runs a real DeepSpeed step of small models (Llama GQA,
Pythia parallel, QK-Norm) and compares the plan for the CPU (native SDPA, torch's AdamW)
with the peak of the CPU allocator as torch's profiler reports it (every allocation and
free of c10's CPU allocator with the running total), after a warm-up step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pretrain.config import Config, ConfigError, ModelConfig, load_config
from pretrain.model.recompute import KEY as CKPT_KEY
from pretrain.model.recompute import describe_recompute, recompute_layers
from pretrain.run_layout import atomic_write

GiB = 2**30
DEFAULT_MFU = 0.40
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size
MIN_MICRO_TOKENS = 16_384  # the planner never picks a micro batch of fewer tokens
CUBLAS_WORKSPACE = 64 * 2**20  # cuBLAS/cuBLASLt workspaces torch keeps per device


# ----------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes the device has (what torch.cuda.get_device_properties reports)
    peak_flops: float  # dense BF16 FLOP/s

    @property
    def gib(self) -> float:
        return self.memory / GiB


GPUS = {
    "h100": GPU("H100 SXM 80GB", 81559 * 2**20, 989e12),
    "h200": GPU("H200 141GB", 143771 * 2**20, 989e12),
}


def parse_gpu(text: str, peak_tflops: float | None = None) -> GPU:
    """'h100', 'h200' or a memory size in GiB ('80', '141.5')."""
    key = text.strip().lower()
    if key in GPUS:
        gpu = GPUS[key]
    else:
        try:
            gib = float(key.removesuffix("gib").removesuffix("g"))
        except ValueError:
            raise ConfigError(
                f"--gpu {text!r} is unknown; use h100, h200 or a memory size in GiB (e.g. 80)"
            ) from None
        if gib <= 0:
            raise ConfigError(f"--gpu {text!r}: the memory must be > 0 GiB")
        gpu = GPU(f"{gib:g} GiB GPU", int(gib * GiB), 989e12)
    if peak_tflops is not None:
        gpu = dataclasses.replace(gpu, peak_flops=peak_tflops * 1e12)
    return gpu


def default_reserve(capacity: int) -> int:
    """Memory kept free of torch's allocations: 2 GiB + 5% of the device."""
    return int(2 * GiB + 0.05 * capacity)


# ----------------------------------------------------------------------------- accounting


class LiveTensors(TorchDispatchMode):
    """Live-tensor accounting at the dispatcher: bytes of the storages operators create.

    A storage counts from the operator that returns it (unless it is one of the operator's
    inputs' storages: views and in-place results) until it is freed (a weak reference's
    callback). `live` is the running total and `peak` its maximum. Storages that existed
    before the mode (parameters, the optimizer's state) are not counted: they are the plan's
    static part. `workspace(func, args, kwargs)`, when given, returns the bytes a kernel
    allocates and frees inside the operator (invisible at the dispatcher), which count
    towards the peak while the operator runs.
    """

    def __init__(self, workspace=None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.workspace = workspace
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        work = self.workspace(func, args, kwargs) if self.workspace is not None else 0
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in inputs or key in self._refs:
                continue
            nbytes = st.nbytes()
            ref = weakref.ref(st, lambda _r, key=key, n=nbytes: self._freed(key, n))
            self._refs[key] = (ref, nbytes)
            self.live += nbytes
        self.peak = max(self.peak, self.live + work)
        return out


def _cpu_flash_splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """Query and key block sizes of torch's CPU flash attention (FlashAttentionKernel.cpp)."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def cpu_kernel_workspace(func, args, kwargs) -> int:
    """Bytes that CPU kernels allocate and free inside one operator (read from ATen):

    - flash attention forward (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp): per
      thread an fp32 buffer of qSplit x kvSplit + 2 qSplit + qSplit x head_dim, and for
      bf16 a qSplit x kvSplit buffer in bf16;
    - its backward: grad_out.contiguous(), per thread 2 qSplit x kvSplit in fp32 (and in
      bf16), and the fp32 row sums `dsum` (qSplit);
    - pointwise operators with operands of another dtype than the result (TensorIterator on
      CPU casts them into temporaries; CUDA casts in the kernel): one temporary per such
      operand, and one for an in-place output of another dtype.
    """
    aten = torch.ops.aten
    threads = torch.get_num_threads()
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k = args[0], args[1]
        qs, ks = _cpu_flash_splits(q.shape[2], k.shape[2])
        reduced = q.dtype in (torch.bfloat16, torch.float16)
        work = threads * (qs * ks + 2 * qs + qs * q.shape[3]) * 4
        return work + (threads * qs * ks * q.element_size() if reduced else 0)
    if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        grad_out, q, k = args[0], args[1], args[2]
        qs, ks = _cpu_flash_splits(q.shape[2], k.shape[2])
        reduced = q.dtype in (torch.bfloat16, torch.float16)
        work = threads * (2 * qs * ks + qs) * 4
        work += threads * 2 * qs * ks * q.element_size() if reduced else 0
        if not grad_out.transpose(1, 2).is_contiguous():
            work += grad_out.numel() * grad_out.element_size()
        return work
    if torch.Tag.pointwise in func.tags:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if len({t.dtype for t in tensors}) < 2:
            return 0
        common = torch.result_type(*tensors[:2]) if len(tensors) >= 2 else tensors[0].dtype
        for t in tensors[2:]:
            common = torch.promote_types(common, t.dtype)
        item = torch.empty((), dtype=common).element_size()
        work = sum(t.numel() * item for t in tensors if t.dtype != common and t.dim() > 0)
        if func._schema.name.endswith("_") and tensors[0].dtype != common:
            work += tensors[0].numel() * item  # in-place result computed in the common dtype
        return work
    return 0


class _FlashAttention2(torch.autograd.Function):
    """Stand-in for SDPA on a GPU (FlashAttention-2): its allocations, no arithmetic."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        out = q.new_empty(B, T, H, D).transpose(1, 2)  # (B, T, H, D) memory, (B, H, T, D) view
        lse = q.new_empty(B, H, T, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        KV, S = k.shape[1], k.shape[2]
        t_round = -(-T // 128) * 128
        d_round = -(-D // 32) * 32 if D <= 192 else 256  # flash_api.cpp: head_size_rounded
        dq = q.new_empty(B, T, H, D).transpose(1, 2)
        dk = k.new_empty(B, S, KV, D).transpose(1, 2)
        dv = v.new_empty(B, S, KV, D).transpose(1, 2)
        work = [
            q.new_empty(B, H, t_round, dtype=torch.float32),  # softmax_d
            q.new_empty(B, t_round, H, d_round, dtype=torch.float32),  # dq_accum
        ]
        if KV != H:  # dk/dv per query head, summed over each group into dk/dv
            work += [k.new_empty(B, S, H, D), v.new_empty(B, S, H, D)]
        del work
        return dq, dk, dv


def _flash_sdpa(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    return _FlashAttention2.apply(q, k, v)


@contextlib.contextmanager
def _attention_kernel(target: str) -> Iterator[None]:
    """Within: SDPA allocates as on `target` ("cuda": FlashAttention-2, "cpu": torch's own)."""
    if target != "cuda":
        yield
        return
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _fake_model(cfg: ModelConfig, dtype: torch.dtype):
    """(fake mode, Transformer built in it with `dtype` weights and the fp32 RoPE cache)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pretrain.model.transformer import Transformer

    mode = FakeTensorMode()
    previous = torch.get_default_dtype()
    with mode:
        torch.set_default_dtype(dtype)
        try:
            model = Transformer(cfg)
        finally:
            torch.set_default_dtype(previous)
    return mode, model


@dataclass
class Trace:
    """Peak bytes above the state that exists before each phase (weights, gradients, ...)."""

    train: int  # forward + backward of one micro batch, inputs included
    train_forward: int  # the forward part alone
    eval: int  # evaluation forward with targets, no gradients
    probe: int  # max attention logits of one sequence


_TRAIN_CACHE: dict[tuple, tuple[int, int]] = {}
_EVAL_CACHE: dict[tuple, tuple[int, int]] = {}


@contextlib.contextmanager
def _whole_logits_loss() -> Iterator[None]:
    """Within: the model's loss is the old one (whole fp32 logits), for before/after figures."""
    from pretrain.model import transformer
    from pretrain.model.loss import reference_cross_entropy

    original = transformer.linear_cross_entropy
    transformer.linear_cross_entropy = lambda h, w, t, ignore_index=-100: reference_cross_entropy(
        h, w, t, ignore_index
    )
    try:
        yield
    finally:
        transformer.linear_cross_entropy = original


def trace_train(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    layers: int,
    target: str = "cuda",
    grads_exist: bool = True,
    whole_logits: bool = False,
) -> tuple[int, int]:
    """(peak of forward + backward, peak of the forward) of one micro batch on fake tensors,
    bytes above what existed before. `grads_exist`: the parameters' .grad exist before the
    backward (a later micro batch of a step with gradient accumulation); else the backward
    creates them, inside the trace."""
    key = (repr(cfg), micro_batch, seq_len, dtype, layers, target, grads_exist, whole_logits)
    if key not in _TRAIN_CACHE:
        mode, model = _fake_model(cfg, dtype)
        loss_ctx = _whole_logits_loss() if whole_logits else contextlib.nullcontext()
        with mode, _attention_kernel(target), loss_ctx:
            if grads_exist:
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            model.train()
            model.gradient_checkpointing = layers
            acct = LiveTensors(cpu_kernel_workspace if target == "cpu" else None)
            with acct:
                x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                loss = model(x, y)
                forward = acct.peak
                loss.backward()
                del loss, x, y
        del model
        gc.collect()
        _TRAIN_CACHE[key] = (acct.peak, forward)
    return _TRAIN_CACHE[key]


def trace_eval(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    target: str = "cuda",
    whole_logits: bool = False,
) -> tuple[int, int]:
    """(peak of the evaluation forward with targets, peak of the max-logit probe on one
    sequence), no gradients, on fake tensors, in bytes above what existed before."""
    key = (repr(cfg), micro_batch, seq_len, dtype, target, whole_logits)
    if key not in _EVAL_CACHE:
        from pretrain.model.probes import attention_logit_maxima

        mode, model = _fake_model(cfg, dtype)
        workspace = cpu_kernel_workspace if target == "cpu" else None
        loss_ctx = _whole_logits_loss() if whole_logits else contextlib.nullcontext()
        with mode, _attention_kernel(target), loss_ctx, torch.no_grad():
            model.eval()
            acct = LiveTensors(workspace)
            with acct:
                x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
                model(x, y)
                del x, y
            gc.collect()
            probe = LiveTensors(workspace)
            with probe:
                attention_logit_maxima(model, torch.randint(0, cfg.vocab_size, (1, seq_len)))
        del model
        gc.collect()
        _EVAL_CACHE[key] = (acct.peak, probe.peak)
    return _EVAL_CACHE[key]


def trace_step(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    layers: int,
    target: str = "cuda",
    grads_exist: bool = True,
    whole_logits: bool = False,
) -> Trace:
    """Every traced phase of a micro batch (train, eval, probe)."""
    train, forward = trace_train(
        cfg, micro_batch, seq_len, dtype, layers, target, grads_exist, whole_logits
    )
    evaluation, probe = trace_eval(cfg, micro_batch, seq_len, dtype, target, whole_logits)
    return Trace(train, forward, evaluation, probe)


# ----------------------------------------------------------------------------- DeepSpeed


@dataclass
class DeepSpeedMemory:
    """What DeepSpeed holds and allocates around the model's own tensors (bytes)."""

    optimizer: str  # which DeepSpeed optimizer wrapper the config selects
    static: dict[str, int]  # live between steps
    grads: int  # the parameters' .grad: live from the first backward of a step to its end
    backward: int  # allocated while the backward runs, on top of the model's tensors
    after_backward: int  # transient right after each backward
    step: int  # transient in the optimizer step


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def deepspeed_memory(
    groups: Sequence[Sequence[int]],
    world_size: int,
    precision: str,
    grad_accum_dtype: str,
    zero_stage: int,
    fused_adam: bool,
    ds_overrides: dict[str, Any] | None = None,
) -> DeepSpeedMemory:
    """DeepSpeed 0.19's buffers for parameter groups of these sizes (numels per group).

    Read from deepspeed/runtime/bf16_optimizer.py, zero/stage_1_and_2.py, engine.py:
    - BF16 + FP32 accumulation + ZeRO-1 -> BF16_Optimizer: each group is flattened into one
      bf16 buffer padded to a multiple of 2 x world size (the parameters become views of
      it); `fp32_groups_gradients_flat` = zeros_like(flat, fp32), the *whole* model's
      gradients; the rank's partition of fp32 master weights (clone().float()); Adam's
      exp_avg and exp_avg_sq of that partition (at the first step). Each parameter's bf16
      .grad is created by the first backward and only zeroed afterwards
      (`clear_lp_grads(set_to_none=False)`). After each backward `_update_hp_grad` does
      `hp.add_(lp.grad.to(fp32))`: one fp32 copy of a gradient at a time. The gradient
      all-reduce works in place on the fp32 buffer (one tensor per bucket: no flatten copy).
    - ZeRO-1/2 with gradients in the parameters' dtype -> DeepSpeedZeroOptimizer: flat
      parameters, parameter .grad in that dtype, fp32 master partition and Adam moments;
      `setup_buckets` allocates torch.empty(reduce_bucket_size) in that dtype at the first
      gradient hook of every backward (two with overlap_comm); the step flattens the
      partition's gradients and casts them to fp32.
    - ZeRO-0: torch's optimizer on the parameters; `buffered_allreduce_fallback` flattens
      up to 5e8 gradient elements into one buffer.
    Adam: DeepSpeed's FusedAdam on CUDA allocates nothing per step; torch's AdamW
    (`torch_adam`, used on CPU) allocates sqrt(v) and sqrt(v)/c per tensor.
    """
    ds = ds_overrides or {}
    zero = ds.get("zero_optimization", {})
    bucket = int(zero.get("reduce_bucket_size", REDUCE_BUCKET))
    overlap = bool(zero.get("overlap_comm", False))
    N = world_size
    sizes = [sum(g) for g in groups]
    largest = max((n for g in groups for n in g), default=0)
    e = 2 if precision == "bf16" else 4
    if precision == "bf16" and grad_accum_dtype == "fp32" and zero_stage == 1:
        flat = [_aligned(n, 2 * N) for n in sizes]
        part = [f // N for f in flat]
        static = {
            "bf16 weights (flat)": 2 * sum(flat),
            "fp32 gradient buffer (whole model)": 4 * sum(flat),
            "fp32 master weights (1/N)": 4 * sum(part),
            "Adam moments (1/N)": 8 * sum(part),
        }
        step = 0 if fused_adam else 8 * max(part)
        return DeepSpeedMemory("BF16_Optimizer", static, 2 * sum(sizes), 0, 4 * largest, step)
    if zero_stage in (1, 2):
        e_grad = 4 if precision == "bf16" and grad_accum_dtype == "fp32" else e
        flat = [_aligned(n, 2 * N) for n in sizes]
        part = [f // N for f in flat]
        grads = e_grad * (sum(part) if zero_stage == 2 else sum(sizes))
        static = {
            f"{'bf16' if e == 2 else 'fp32'} weights (flat)": e * sum(flat),
            "fp32 master weights (1/N)": 4 * sum(part),
            "Adam moments (1/N)": 8 * sum(part),
        }
        backward = e_grad * bucket * (2 if overlap else 1)
        step = (e_grad + 4) * max(part) + (0 if fused_adam else 8 * max(part))
        name = f"DeepSpeedZeroOptimizer (ZeRO-{zero_stage})"
        return DeepSpeedMemory(name, static, grads, backward, 0, step)
    # ZeRO-0: no ZeRO wrapper
    total = sum(sizes)
    static = {
        f"{'bf16' if e == 2 else 'fp32'} weights": e * total,
        "Adam moments": 8 * total,
    }
    if e == 2:
        static["fp32 master weights"] = 4 * total
    flat_copy = e * min(total, REDUCE_BUCKET + largest)
    return DeepSpeedMemory(
        "torch optimizer (ZeRO-0)",
        static,
        e * total,
        0,
        flat_copy,
        0 if fused_adam else 8 * largest,
    )


# ----------------------------------------------------------------------------- the plan


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
        return self.static_bytes + max(
            self.grads + self.trace.train + ds.backward, grads + ds.after_backward, grads + ds.step
        )

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
            "step_time_s_at_100pct": self.step_time(1.0),
            "step_time_s": self.step_time(mfu),
            "run_time_h_at_100pct": self.run_time(1.0) / 3600,
            "run_time_h": self.run_time(mfu) / 3600,
            "gpu_hours": self.gpu_hours(mfu),
            "mfu": mfu,
            "notes": self.notes,
        }


def _meta_model(cfg: ModelConfig):
    from pretrain.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int, layers: int) -> tuple[float, float]:
    """(model FLOPs per token, executed FLOPs per token with `layers` blocks recomputed).

    Model: `Transformer.flops_per_token` (6 x matmul weights + attention, PaLM's count).
    A recomputed block runs its forward once more: 2 x its matmul weights + 4 x n_heads x
    head_dim x seq_len (QK^T and AV) per token.
    """
    model = _meta_model(cfg)
    model_flops = model.flops_per_token(seq_len)
    block = sum(
        m.weight.numel() for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)
    )
    per_block = 2 * block + 4 * cfg.n_heads * cfg.head_dim * seq_len
    return model_flops, model_flops + layers * per_block


def _param_groups(cfg: Config) -> list[list[int]]:
    from pretrain.train.engine import param_groups

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
) -> Plan:
    """The plan of `cfg` on `world_size` GPUs (micro batch and recomputed layers as given,
    else the config's; the config's "auto" must be resolved first: `choose`).
    `whole_logits`: plan the loss as it was before the chunked one (for comparisons)."""
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
    trace = trace_step(cfg.model, mb, seq, dtype, layers, target, gas > 1, whole_logits)
    groups = _param_groups(cfg)
    fused = target == "cuda"
    ds = deepspeed_memory(
        groups, world_size, t.precision, t.grad_accum_dtype, t.zero_stage, fused, t.deepspeed
    )
    static = dict(ds.static)
    rope = 2 * cfg.model.max_seq_len * cfg.model.rope_dims * 4
    static["RoPE cos/sin cache"] = rope
    if target == "cuda":
        static["cuBLAS workspaces"] = CUBLAS_WORKSPACE
    static = {k: v for k, v in static.items() if v}
    model_flops, executed = flops_per_token(cfg.model, seq, layers)
    notes = []
    if t.zero_stage == 2:
        notes.append("ZeRO-2: DeepSpeed's buffers are estimated from its source, not validated")
    return Plan(
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


def resolve_activation_checkpointing(cfg: Config, world_size: int, device: torch.device) -> int:
    """The number of blocks to recompute for this run; "auto" plans it for this device
    (at the configured micro batch) and says so on rank 0."""
    L = cfg.model.n_layers
    layers = recompute_layers(cfg.train.activation_checkpointing, L)
    if layers is not None:
        return layers
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = GPU(props.name, props.total_memory, 989e12)
        target = "cuda"
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        gpu, target = GPU("CPU (host memory)", memory, 1e12), "cpu"
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


# ----------------------------------------------------------------------------- validation


@dataclass
class Validation:
    name: str
    n_params: int
    predicted: int
    measured: int
    live_at_eval: list[str] = field(default_factory=list)  # the allocator's view, to diagnose

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


# What docs/performance.md claims and tests/test_plan.py holds: measured +0.04% (training) and
# +0.21% (evaluation, the batch's ids counted) on an AVX2 EPYC; on an AVX-512-BF16 Xeon the
# kernel path pinned_cpu_kernels selects (there set by DNNL_MAX_CPU_ISA=AVX2) gave +0.04%.
VALIDATION_TOLERANCE = 0.005

# Small enough for a CPU without bf16 matrix units (bf16 matmuls run at ~1 GFLOP/s there),
# large enough that activations, the loss chunks and DeepSpeed's buffers all matter.
VALIDATION_SHAPES: dict[str, dict[str, Any]] = {
    "llama (GQA, sequential)": dict(
        vocab_size=512,
        n_layers=4,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=192,
        rope_fraction=0.25,
    ),
    "pythia (parallel, MHA)": dict(
        vocab_size=512,
        n_layers=4,
        d_model=64,
        n_heads=2,
        d_ff=160,
        block="parallel",
        rope_fraction=0.1,
    ),
    "llama + QK-Norm (NoPE)": dict(
        vocab_size=512,
        n_layers=4,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=192,
        qk_norm=True,
        rope_fraction=0.0,
    ),
}


def validation_config(
    shape: dict[str, Any],
    micro_batch: int = 4,
    seq_len: int = 256,
    layers: int = 2,
    precision: str = "bf16",
    grad_accum: str = "fp32",
    zero_stage: int = 1,
    accumulation: int = 1,
) -> Config:
    """A one-process run config of `shape` (bf16, ZeRO-1, fp32 accumulation: the paper's)."""
    from pretrain.config import from_dict

    return from_dict(
        Config,
        {
            "model": {
                "pad_vocab_to_multiple": 128,
                "max_seq_len": seq_len,
                "mlp_bias": True,
                **shape,
            },
            "train": {
                "train_iters": 10,
                "global_batch_size": micro_batch * accumulation,
                "micro_batch_size": micro_batch,
                "seq_len": seq_len,
                "precision": precision,
                "grad_accum_dtype": grad_accum,
                "zero_stage": zero_stage,
                "activation_checkpointing": layers,
            },
        },
    )


def _allocator_events(prof) -> list[tuple[int, int, int, str]]:
    """(time ns, bytes, address, operator path) of every CPU allocation (bytes > 0) and free
    (< 0) the profiler saw, in time order."""
    out = []
    alloc = torch._C._profiler._EventType.Allocation
    stack = [(node, "") for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, path = stack.pop()
        if node.tag == alloc:
            f = node.extra_fields
            if f.device.type == "cpu":
                out.append((node.start_time_ns, f.alloc_size, f.ptr, path))
            continue
        stack.extend((child, f"{path}/{node.name}") for child in node.children)
    return sorted(out)


def allocated_over_time(events: list[tuple[int, int, int, str]]) -> list[tuple[int, int]]:
    """(time ns, bytes live) after each event, counting only memory allocated within the
    profiled window: a free of an address allocated before it is ignored. (c10's own running
    total does the same only for its first window: it keeps counting what earlier windows
    allocated and freed while no profiler listened.)"""
    live: dict[int, int] = {}
    total, out = 0, []
    for ts, nbytes, ptr, _ in events:
        if nbytes > 0:
            total += nbytes - live.pop(ptr, 0)  # an address reused: its free went unseen
            live[ptr] = nbytes
        elif ptr in live:
            total -= live.pop(ptr)
        out.append((ts, total))
    return out


def live_at(events: list[tuple[int, int, int, str]], when: int, top: int = 8) -> list[str]:
    """The largest allocations of the window still live at time `when`, with their operator."""
    live: dict[int, tuple[int, str]] = {}
    for ts, nbytes, ptr, path in events:
        if ts > when:
            break
        if nbytes > 0:
            live[ptr] = (nbytes, path)
        else:
            live.pop(ptr, None)
    biggest = sorted(live.values(), key=lambda v: -v[0])[:top]
    return [f"{n:>12,} B  {path[-100:]}" for n, path in biggest]


LAST_MEASUREMENT: dict[str, Any] = {}  # what measure_cpu_step saw last (for diagnosis)


@contextlib.contextmanager
def pinned_cpu_kernels() -> Iterator[None]:
    """Within: bf16 matmuls take ATen's own GEMM on every x86 CPU, as on one without AVX-512.

    On a CPU with AVX-512-BF16 (or AMX) torch sends bf16 matmuls to oneDNN
    (`mkldnn_bf16_gemm`, enabled by `ideep::has_bf16_type_support()`), which allocates
    scratch memory of its own inside `aten::mm` (460,544 B at the peak of the validation's
    loss chunk on a Xeon with AVX-512-BF16, docs/performance.md) that the CPU plan does
    not model: the plan models the kernels a GPU step replaces, not oneDNN's. With
    `torch.backends.mkldnn` off, the validation measures the same kernel path on an AVX2
    EPYC and on that Xeon (the effect of DNNL_MAX_CPU_ISA=AVX2, which oneDNN reads only
    once per process)."""
    before = torch.backends.mkldnn.enabled  # (mkldnn.flags() also warns about Intel GPUs' TF32)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


@contextlib.contextmanager
def one_rank_all_reduce_inline() -> Iterator[None]:
    """Within, on one rank: torch.distributed.all_reduce returns at once, the identity it is.

    gloo runs an all-reduce on a worker thread, and that thread can drop the last reference
    to DeepSpeed's flattened gradient buffer (`allreduce_bucket`); the profiler does not
    follow gloo's threads, so that free was never seen and the buffer (1 MB in the
    validation's shapes) looked live to the end of the window: the measured peak came out
    5 to 16% high in about one validation in five, at random. With the call inline the
    buffer is allocated and freed on this thread, as on a GPU (NCCL frees nothing of ours)."""
    import torch.distributed as dist

    real = dist.all_reduce
    if dist.is_initialized() and dist.get_world_size() > 1:
        yield
        return

    def identity(tensor, op=None, group=None, async_op=False):
        return None

    dist.all_reduce = identity
    try:
        yield
    finally:
        dist.all_reduce = real


def cpu_kernel_path() -> str:
    """The CPU's vector ISA as torch uses it, and whether bf16 matmuls would go to oneDNN."""
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (
        f"{torch.backends.cpu.get_cpu_capability()}, bf16 matmuls "
        f"{'oneDNN (pinned to ATen for the validation)' if onednn else 'ATen'}"
    )


def _profile_steps(cfg, engine_args, batches, steps, gas):
    import deepspeed
    from torch.profiler import ProfilerActivity, profile, record_function

    from pretrain.model.transformer import Transformer
    from pretrain.train.engine import param_groups

    t = cfg.train
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        model.gradient_checkpointing = recompute_layers(
            t.activation_checkpointing, cfg.model.n_layers
        )
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg), **engine_args
        )
        del model
        for i in range(steps):
            with record_function(f"plan_step_{i}"):
                for x, y in batches[i * gas : (i + 1) * gas]:
                    loss = engine(x, targets=y)
                    engine.backward(loss)
                    engine.step()
                    del loss
        with record_function("plan_eval"), torch.no_grad():
            engine.module.eval()
            engine(batches[0][0], targets=batches[0][1])
        del engine
        gc.collect()  # this window's engine dies inside it
    return prof


def measure_cpu_step(cfg: Config, steps: int = 2) -> tuple[int, int]:
    """(training peak, evaluation peak) of c10's CPU allocator in bytes: the peak during the
    last of `steps` real DeepSpeed optimizer steps (every micro batch's forward, backward
    and `engine.step`, as the trainer runs them) of `cfg` on one process, and during an
    evaluation forward after it. Everything (model, DeepSpeed, optimizer) is allocated
    inside the profiled window, whose start is the zero."""
    import logging

    from deepspeed.utils import logger

    from pretrain.train import distributed as dist_utils
    from pretrain.train.engine import deepspeed_config, grad_accum_steps

    if not torch.distributed.is_initialized():
        dist_utils.setup_env()
        dist_utils.init_process_group(torch.device("cpu"))
    logger.setLevel(logging.WARNING)
    device = torch.device("cpu")
    t = cfg.train
    gas = grad_accum_steps(cfg, 1)
    # The CPU plan models the optimizer DeepSpeed builds itself (torch's single-tensor AdamW):
    # measure that path, whatever optim.impl the config asks for.
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, impl="deepspeed"))
    engine_args = {"config": deepspeed_config(cfg, 1, device), "dist_init_required": False}
    gen = torch.Generator().manual_seed(0)
    shape = (t.micro_batch_size, cfg.seq_len)
    batches = [
        (
            torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
            torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
        )
        for _ in range(steps * gas)
    ]
    # Python's cycle collector would free a previous engine at a random point inside the
    # window; collect first and keep it off until this window's engine is gone.
    # (Freezing what exists also keeps DeepSpeed's many gc.collect() calls short.)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        with pinned_cpu_kernels(), one_rank_all_reduce_inline():
            prof = _profile_steps(cfg, engine_args, batches, steps, gas)
    finally:
        gc.enable()
        gc.unfreeze()
    events = _allocator_events(prof)
    totals = allocated_over_time(events)
    ranges = {
        e.name(): (e.start_ns(), e.end_ns())
        for e in prof.profiler.kineto_results.events()
        if e.name() in (f"plan_step_{steps - 1}", "plan_eval")
    }

    def peak(name: str) -> int:
        start, end = ranges[name]
        return max(total for ts, total in totals if start <= ts <= end)

    LAST_MEASUREMENT.clear()
    LAST_MEASUREMENT["live_at_eval"] = live_at(events, ranges["plan_eval"][0])
    return peak(f"plan_step_{steps - 1}"), peak("plan_eval")


def validate(shapes: dict[str, dict[str, Any]] | None = None, **kw: Any) -> list[Validation]:
    """Planned vs measured training and evaluation peaks of a real CPU step per shape."""
    out = []
    for name, shape in (shapes or VALIDATION_SHAPES).items():
        cfg = validation_config(shape, **kw)
        plan = plan_run(cfg, GPU("CPU", 1 << 50, 1e12), 1, target="cpu", reserve=0)
        train, evaluation = measure_cpu_step(cfg)
        live = list(LAST_MEASUREMENT.get("live_at_eval", []))
        out.append(Validation(name, plan.n_params, plan.train_peak, train, live))
        out.append(Validation(f"{name}, eval", plan.n_params, plan.eval_peak, evaluation, live))
    return out


# ----------------------------------------------------------------------------- paper runs

PAPER_PLAN = Path(__file__).with_name("sweep_plan.json")  # written by `plan --paper --write`
SLURM_MAX_HOURS = 48  # longest job the generated scripts ask for; longer runs requeue
SLURM_MARGIN = 1.25  # on top of the planned run time, plus half an hour for start and saves


def time_limit_hours(executed_run_hours: float) -> int:
    """Hours for a run's `#SBATCH --time`: its run time on *executed* FLOPs (recompute costs
    time) x SLURM_MARGIN + 0.5 h, rounded up, at most SLURM_MAX_HOURS."""
    return min(SLURM_MAX_HOURS, math.ceil(executed_run_hours * SLURM_MARGIN + 0.5))


def slurm_hours(plan: Plan, mfu: float = DEFAULT_MFU) -> int:
    """`time_limit_hours` of a plan, the run at `mfu` of the peak."""
    return time_limit_hours(plan.run_time(mfu) * plan.recompute_ratio / 3600)


def plan_paper_run(
    config: str | Path,
    world_size: int = 32,
    mfu: float = DEFAULT_MFU,
    overrides: Sequence[str] = (),
    tokens_per_step: int | None = None,
) -> dict[str, Any]:
    """One row of the paper's plan: the config as it is on an H200 and an H100, and what
    `auto` picks on an H200 (micro batch and recomputed blocks, global batch kept).
    `tokens_per_step`: set the global batch to this many tokens / seq_len."""
    cfg = load_config(config, list(overrides))
    if tokens_per_step:
        cfg.train.global_batch_size = tokens_per_step // cfg.seq_len
    name = Path(config).stem
    h200, h100 = GPUS["h200"], GPUS["h100"]
    as_is = plan_run(cfg, h200, world_size, name=name)
    on_h100 = plan_run(cfg, h100, world_size, name=name)
    auto = choose(cfg, h200, world_size, name=name)
    row: dict[str, Any] = {
        "name": name,
        "seq_len": cfg.seq_len,
        "global_batch": cfg.train.global_batch_size,
        "micro_batch": as_is.micro_batch,
        "grad_accum": as_is.grad_accum,
        "checkpointing": as_is.layers,
        "n_layers": as_is.n_layers,
        "train_peak_gib": round(as_is.train_peak / GiB, 2),
        "eval_peak_gib": round(as_is.eval_peak / GiB, 2),
        "fits_h200": as_is.fits,
        "fits_h100": on_h100.fits,
        "model_flops": as_is.model_flops,
        "executed_flops": as_is.executed_flops,
        "run_hours": round(as_is.run_time(mfu) / 3600, 2),
        "gpu_hours": round(as_is.gpu_hours(mfu)),
    }
    if auto is not None:
        row["auto_h200"] = {
            "micro_batch": auto.micro_batch,
            "grad_accum": auto.grad_accum,
            "checkpointing": auto.layers,
            "train_peak_gib": round(auto.train_peak / GiB, 2),
            "eval_peak_gib": round(auto.eval_peak / GiB, 2),
            "executed_flops": auto.executed_flops,
            "recompute_ratio": round(auto.recompute_ratio, 4),
            "slurm_hours": slurm_hours(auto, mfu),
        }
    return row


def paper_plan(
    configs: Sequence[str | Path],
    world_size: int = 32,
    mfu: float = DEFAULT_MFU,
    overrides: Sequence[str] = (),
    out: Path | None = None,
    log: Any = None,
    tokens_per_step: int | None = None,
) -> list[dict[str, Any]]:
    """Rows of `plan_paper_run` for every config; with `out`, written after each row and
    rows already there (same name) are kept, so an interrupted run continues."""
    done: dict[str, dict[str, Any]] = {}
    if out is not None and out.is_file():
        done = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    rows = []
    for config in configs:
        name = Path(config).stem
        if name not in done:
            t0 = time.perf_counter()
            done[name] = plan_paper_run(config, world_size, mfu, overrides, tokens_per_step)
            if log is not None:
                print(f"planned {name} in {time.perf_counter() - t0:.0f} s", file=log, flush=True)
        rows.append(done[name])
        if out is not None:
            meta = {
                "world_size": world_size,
                "mfu": mfu,
                "overrides": list(overrides),
                "tokens_per_step": tokens_per_step,
                "gpus": {k: {"name": g.name, "gib": round(g.gib, 2)} for k, g in GPUS.items()},
                "reserve": "2 GiB + 5% of the GPU",
            }
            atomic_write(
                out, json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n", fsync=False
            )
    return rows


def _hours(h: float) -> str:
    return f"{h:.1f} h"


def paper_table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of docs/performance.md."""
    head = (
        "| run | seq | global batch | micro x accum | recompute | train peak | eval peak | H200 "
        "| H100 | exec. FLOPs/token | run time at 40% MFU | auto on H200: micro x accum, "
        "recompute, exec./model, train peak, Slurm --time |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        a = r.get("auto_h200")
        auto = (
            f"{a['micro_batch']} x {a['grad_accum']}, {a['checkpointing']}/{r['n_layers']}, "
            f"{a['recompute_ratio']:.3f}x, {a['train_peak_gib']:.1f} GiB, {a['slurm_hours']} h"
            if a
            else "nothing fits"
        )
        lines.append(
            f"| {r['name']} | {r['seq_len']} | {r['global_batch']} | {r['micro_batch']} x "
            f"{r['grad_accum']} | {r['checkpointing']}/{r['n_layers']} | "
            f"{r['train_peak_gib']:.1f} GiB | {r['eval_peak_gib']:.1f} GiB "
            f"| {'fits' if r['fits_h200'] else 'no'} | {'fits' if r['fits_h100'] else 'no'} "
            f"| {r['executed_flops']:.3g} | {_hours(r['run_hours'])} | {auto} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- output


def _h(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:.1f} h" if h >= 1 else f"{seconds / 60:.1f} min"


def format_plan(p: Plan, mfu: float, largest_mb: int | None = None) -> str:
    g = GiB
    lines = [
        f"{p.name or 'run'}: {p.n_params / 1e9:.3g}B parameters, {p.world_size} x {p.gpu.name} "
        f"({p.gpu.gib:.1f} GiB), {p.optimizer}",
        f"  micro batch {p.micro_batch} x {p.grad_accum} accumulation x {p.world_size} GPUs, "
        f"seq {p.seq_len}; activation checkpointing: {describe_recompute(p.layers, p.n_layers)}",
        "  memory per GPU (allocated by torch):",
    ]
    for k, v in p.static.items():
        lines.append(f"    {k:<38} {v / g:8.2f} GiB")
    lines += [
        f"    {'= state between steps':<38} {p.static_bytes / g:8.2f} GiB",
        f"    {'+ gradients (.grad) during a step':<38} {p.ds.grads / g:8.2f} GiB",
        f"    {'+ forward/backward of a micro batch':<38} {(p.trace.train + p.ds.backward) / g:8.2f} GiB"
        f"  (forward alone {p.trace.train_forward / g:.2f})",
        f"    {'+ after backward / optimizer step':<38} {max(p.ds.after_backward, p.ds.step) / g:8.2f} GiB",
        f"  train peak {p.train_peak / g:.2f} GiB, eval peak {p.eval_peak / g:.2f} GiB, "
        f"max-logit probe {p.probe_peak / g:.2f} GiB",
        f"  {'FITS' if p.fits else 'DOES NOT FIT'}: peak {p.peak / g:.2f} GiB + reserve "
        f"{p.reserve / g:.1f} GiB vs {p.gpu.gib:.1f} GiB",
    ]
    if largest_mb is not None:
        lines.append(f"  largest micro batch that fits with this checkpointing: {largest_mb}")
    lines += [
        f"  FLOPs per token: model {p.model_flops:.3e}, executed {p.executed_flops:.3e} "
        f"({p.recompute_ratio:.3f}x with recompute)",
        f"  step ({p.tokens_per_step:,} tokens): {p.step_time(1.0):.2f} s at 100% MFU, "
        f"{p.step_time(mfu):.2f} s at {100 * mfu:.0f}% MFU",
        f"  run ({p.steps:,} steps): {_h(p.run_time(1.0))} at 100% MFU, {_h(p.run_time(mfu))} at "
        f"{100 * mfu:.0f}% MFU = {p.gpu_hours(mfu):,.0f} GPU-hours",
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python tools/plan.py`: a user error -> one line, exit 2 (pretrain/cli/errors.py)."""
    from pretrain.cli.errors import user_errors

    return user_errors(_main)(None if argv is None else list(argv))


def _main(argv: list[str] | None = None) -> int:
    from pretrain.cli.errors import ArgumentParser

    ap = ArgumentParser(
        prog="plan", description="Memory and time plan of a run, traced on fake tensors."
    )
    ap.add_argument("config", nargs="?", help="run config (YAML)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. train.micro_batch_size=32",
    )
    ap.add_argument("--gpu", default="h200", help="h100, h200 or memory in GiB (default h200)")
    ap.add_argument("--gpus", type=int, default=32, help="number of GPUs (data parallel)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilization")
    ap.add_argument("--peak-tflops", type=float, help="peak dense BF16 TFLOP/s per GPU (989)")
    ap.add_argument("--reserve-gib", type=float, help="memory kept free (2 GiB + 5%% of the GPU)")
    ap.add_argument("--checkpointing", help="none, full, N layers or auto (default: the config's)")
    ap.add_argument("--micro-batch", type=int, help="micro batch (default: the config's)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument(
        "--validate",
        action="store_true",
        help="check the planner against the CPU allocator on small models",
    )
    ap.add_argument(
        "--paper",
        action="store_true",
        help="plan every paper run (pretrain/sweep.py) and print docs/performance.md's table",
    )
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        help="with --paper: global batch = this / seq_len (the paper: 8388608)",
    )
    ap.add_argument(
        "--write",
        action="store_true",
        help=f"with --paper: write the plans to {PAPER_PLAN.name} (read by the sweep)",
    )
    args = ap.parse_args(argv)
    if args.validate:
        return _main_validate()
    if args.paper:
        return _main_paper(args)
    if not args.config:
        ap.error("give a CONFIG (or --validate)")
    return _main_plan(args)


def _main_plan(args) -> int:
    overrides = list(args.set)
    if args.checkpointing is not None:
        overrides.append(f"train.activation_checkpointing={args.checkpointing}")
    if args.micro_batch is not None:
        if args.micro_batch <= 0:
            raise ConfigError(f"--micro-batch {args.micro_batch} must be a positive integer")
        overrides.append(f"train.micro_batch_size={args.micro_batch}")
    cfg = load_config(args.config, overrides)
    if args.gpus <= 0:
        raise ConfigError(f"--gpus {args.gpus} must be a positive integer")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu} must be in (0, 1], e.g. 0.4")
    gpu = parse_gpu(args.gpu, args.peak_tflops)
    reserve = None if args.reserve_gib is None else int(args.reserve_gib * GiB)
    name = Path(args.config).stem
    auto = recompute_layers(cfg.train.activation_checkpointing, cfg.model.n_layers) is None
    if auto:
        plan = choose(
            cfg,
            gpu,
            args.gpus,
            change_micro_batch=args.micro_batch is None,
            reserve=reserve,
            name=name,
        )
        if plan is None:
            print(
                f"{name}: nothing fits {gpu.name} ({gpu.gib:.1f} GiB) on {args.gpus} GPUs, "
                f"even with full recompute at the smallest micro batch"
            )
            return 1
        plan.notes.append(
            f"auto picked micro batch {plan.micro_batch} x {plan.grad_accum} "
            f"accumulation, recompute: {describe_recompute(plan.layers, plan.n_layers)}"
        )
    else:
        plan = plan_run(cfg, gpu, args.gpus, reserve=reserve, name=name)
    largest = largest_micro_batch(cfg, gpu, args.gpus, plan.layers, reserve=reserve)
    if args.json:
        print(json.dumps({**plan.summary(args.mfu), "largest_micro_batch": largest}, indent=2))
    else:
        print(format_plan(plan, args.mfu, largest))
    return 0 if plan.fits else 1


def _main_paper(args) -> int:
    from pretrain.sweep import paper_runs

    repo = Path(__file__).resolve().parents[1]
    configs = [repo / run.config_path for run in paper_runs()]
    out = PAPER_PLAN if args.write else None
    rows = paper_plan(configs, args.gpus, args.mfu, args.set, out, sys.stderr, args.tokens_per_step)
    print(paper_table(rows))
    return 0


def _main_validate() -> int:
    print(
        "planner vs CPU allocator (real DeepSpeed steps on CPU: bf16, ZeRO-1, fp32 gradient "
        "accumulation, 2 of 4 blocks recomputed, micro batch 4 x 256):"
    )
    print(f"  CPU kernels: {cpu_kernel_path()}")
    worst, bad = 0.0, []
    for v in validate():
        worst = max(worst, abs(v.error))
        if abs(v.error) > VALIDATION_TOLERANCE:
            bad.append(v)
        print(
            f"  {v.name:<32} {v.n_params / 1e6:4.2f}M params: planned "
            f"{v.predicted / 2**20:7.2f} MiB, allocator {v.measured / 2**20:7.2f} MiB, "
            f"error {100 * v.error:+.2f}%"
        )
    for v in bad:
        print(f"  {v.name}: the allocator's largest live allocations before the evaluation:")
        print("\n".join(f"    {line}" for line in v.live_at_eval))
    ok = worst <= VALIDATION_TOLERANCE
    print(
        f"{'OK' if ok else 'FAILED'}: largest error {100 * worst:.2f}% "
        f"(target {100 * VALIDATION_TOLERANCE:g}%)"
    )
    return 0 if ok else 1


__all__ = [
    "GPU",
    "GPUS",
    "DeepSpeedMemory",
    "LiveTensors",
    "Plan",
    "Trace",
    "choose",
    "deepspeed_memory",
    "flops_per_token",
    "largest_micro_batch",
    "least_recompute",
    "main",
    "measure_cpu_step",
    "parse_gpu",
    "plan_run",
    "resolve_activation_checkpointing",
    "trace_step",
    "validate",
]

if __name__ == "__main__":
    sys.exit(main())
