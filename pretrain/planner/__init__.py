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

import importlib
from typing import Any

# Name -> the module that defines it. The package loads a module only when one of its names
# is asked for: `pretrain.planner.gpus` (the GPUs, DEFAULT_MFU) stays light, while the
# tracer (torch) loads with the first trace.
_LAZY = {
    "compiled_extra_bytes": "pretrain.planner.compiled",
    "DeepSpeedMemory": "pretrain.planner.deepspeed_buffers",
    "deepspeed_memory": "pretrain.planner.deepspeed_buffers",
    "CUBLAS_WORKSPACE": "pretrain.planner.gpus",
    "DEFAULT_MFU": "pretrain.planner.gpus",
    "GPU": "pretrain.planner.gpus",
    "GPUS": "pretrain.planner.gpus",
    "MIN_MICRO_TOKENS": "pretrain.planner.gpus",
    "REDUCE_BUCKET": "pretrain.planner.gpus",
    "GiB": "pretrain.planner.gpus",
    "default_reserve": "pretrain.planner.gpus",
    "parse_gpu": "pretrain.planner.gpus",
    "PAPER_PLAN": "pretrain.planner.paper",
    "paper_plan": "pretrain.planner.paper",
    "paper_table": "pretrain.planner.paper",
    "plan_paper_run": "pretrain.planner.paper",
    "slurm_hours": "pretrain.planner.paper",
    "Plan": "pretrain.planner.search",
    "choose": "pretrain.planner.search",
    "compiled_step_fits": "pretrain.planner.search",
    "flops_per_token": "pretrain.planner.search",
    "largest_micro_batch": "pretrain.planner.search",
    "least_recompute": "pretrain.planner.search",
    "micro_batch_candidates": "pretrain.planner.search",
    "micro_batch_on": "pretrain.planner.search",
    "plan_run": "pretrain.planner.search",
    "resolve_activation_checkpointing": "pretrain.planner.search",
    "LiveTensors": "pretrain.planner.trace",
    "Trace": "pretrain.planner.trace",
    "cpu_kernel_workspace": "pretrain.planner.trace",
    "trace_eval": "pretrain.planner.trace",
    "trace_step": "pretrain.planner.trace",
    "trace_train": "pretrain.planner.trace",
    "LAST_MEASUREMENT": "pretrain.planner.validation",
    "VALIDATION_SHAPES": "pretrain.planner.validation",
    "VALIDATION_TOLERANCE": "pretrain.planner.validation",
    "Validation": "pretrain.planner.validation",
    "allocated_over_time": "pretrain.planner.validation",
    "cpu_kernel_path": "pretrain.planner.validation",
    "live_at": "pretrain.planner.validation",
    "measure_cpu_step": "pretrain.planner.validation",
    "one_rank_all_reduce_inline": "pretrain.planner.validation",
    "pinned_cpu_kernels": "pretrain.planner.validation",
    "validate": "pretrain.planner.validation",
    "validation_config": "pretrain.planner.validation",
    "SLURM_MARGIN": "pretrain.slurm_limits",
    "SLURM_MAX_HOURS": "pretrain.slurm_limits",
    "time_limit_hours": "pretrain.slurm_limits",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pretrain.planner' has no attribute {name!r}")


__all__ = [
    "CUBLAS_WORKSPACE",
    "DEFAULT_MFU",
    "DeepSpeedMemory",
    "GPU",
    "GPUS",
    "GiB",
    "LAST_MEASUREMENT",
    "LiveTensors",
    "MIN_MICRO_TOKENS",
    "PAPER_PLAN",
    "Plan",
    "REDUCE_BUCKET",
    "SLURM_MARGIN",
    "SLURM_MAX_HOURS",
    "Trace",
    "VALIDATION_SHAPES",
    "VALIDATION_TOLERANCE",
    "Validation",
    "allocated_over_time",
    "choose",
    "compiled_extra_bytes",
    "compiled_step_fits",
    "cpu_kernel_path",
    "cpu_kernel_workspace",
    "deepspeed_memory",
    "default_reserve",
    "flops_per_token",
    "largest_micro_batch",
    "least_recompute",
    "live_at",
    "measure_cpu_step",
    "micro_batch_candidates",
    "micro_batch_on",
    "one_rank_all_reduce_inline",
    "paper_plan",
    "paper_table",
    "parse_gpu",
    "pinned_cpu_kernels",
    "plan_paper_run",
    "plan_run",
    "resolve_activation_checkpointing",
    "slurm_hours",
    "time_limit_hours",
    "trace_eval",
    "trace_step",
    "trace_train",
    "validate",
    "validation_config",
]
