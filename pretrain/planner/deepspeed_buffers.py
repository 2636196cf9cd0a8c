"""DeepSpeed's own buffers around the model's tensors, from its source (deepspeed 0.19)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pretrain.planner.gpus import REDUCE_BUCKET


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
