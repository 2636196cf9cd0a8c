"""What torch.compile adds to a step's memory, on CUDA, over the eager trace.

The planner traces the eager model on fake tensors (trace.py). Inductor's graph keeps other
tensors for the backward than the eager model does, and it cannot be traced without a GPU:
on CPU, inductor saves *less* than eager for both block types (traced at a tiny size, see
docs/performance.md), while on an H100 and an H200 the compiled step allocated more than the
eager plan: pythia1b (parallel block) 5.84 GiB at micro batch 16 (H100) and 9.12 GiB at 32
(H200), llama1b (sequential) 0.60 GiB at 16 (H100) and -1.40 GiB at 32 (H200), seq 2048,
16 layers of width 2048 (docs/gpu_runs/). The allowance is the largest excess per element of
one (micro batch, seq, d_model) activation per layer, rounded up: 6 bytes for parallel blocks
(5.84 and 4.56 measured: one fp32 and one bf16 copy), 1 byte for sequential ones (0.60 and
negative). It over-plans the four measured runs by 0.3-3.4% and under-plans none, which is
what `train.compile: auto` needs: it must never turn a fitting run into an out-of-memory one.
gpu-check's compile stages hold each new measurement to it.

A recomputed block keeps only its input between forward and backward; its compiled excess
lives while it is recomputed, one block at a time, so recompute counts one layer's allowance.
"""

from __future__ import annotations

from pretrain.config import Config

BYTES_PER_ACTIVATION_ELEMENT = {"parallel": 6, "sequential": 1}


def compiled_extra_bytes(cfg: Config, micro_batch: int, recomputed: int, target: str) -> int:
    """Bytes a compiled training step holds over the eager plan (0 off CUDA: not measured
    there, and the CPU trace shows less, not more)."""
    if target != "cuda":
        return 0
    m = cfg.model
    per_layer = BYTES_PER_ACTIVATION_ELEMENT[m.block] * micro_batch * cfg.seq_len * m.d_model
    kept = m.n_layers - recomputed
    return per_layer * (kept + (1 if recomputed else 0))


def compiles(cfg: Config, target: str) -> bool | None:
    """Whether a run of `cfg` on `target` is compiled: True/False, or None for `auto` on
    CUDA, which compiles where the compiled step fits (plan_run decides)."""
    value = cfg.train.compile
    if value == "auto":
        return None if target == "cuda" else False
    return bool(value)
