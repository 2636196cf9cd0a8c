"""Which attention kernel runs: read from the profiler's kernel and operator names, for every
attention shape of configs/paper (and the character-level study's), against the kernel
that torch's documented constraints predict.

Predicted (`predicted_kernel`), from torch's documentation of
`F.scaled_dot_product_attention` and the checks it names (ATen's sdp_utils): on CUDA,
FlashAttention-2 takes bf16/fp16 on sm80 and newer with head_dim a multiple of 8 up to 256,
causal masks, dropout and GQA (`enable_gqa`); otherwise the memory-efficient kernel (head
dims multiples of 8, no GQA), else the math path. On CPU torch's flash kernel runs unless
attention dropout is on (then the math path). Our model's own switches come first: an
attention-logit soft cap runs our unfused path; a document mask runs FlexAttention or the
masked SDPA (pretrain/model/document_attention.py: `document_attention_backend`).
The planner's GPU memory assumes FlashAttention-2 (pretrain/planner/__init__.py): a
different measured kernel here also means its attention memory is not what was planned.

Measured (`kernel_family`): one layer of the config's shape (its head_dim, heads, kv heads,
sequence and dropout; vocabulary 128) runs a training forward and backward in bf16 under
torch.profiler; the names of what ran (CUDA kernels on a GPU, ATen operators on CPU) are
matched to a family.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pretrain.config import Config, ModelConfig, load_config
from pretrain.gpucheck.results import check
from pretrain.gpucheck.sizes import CHAR_CONFIG, REPO, Context
from pretrain.model.document_attention import document_attention_backend
from pretrain.model.transformer import Transformer

# Name fragments of each family, first match wins: CUDA kernel names (flash_fwd_kernel,
# fmha_cutlassF..., cudnn's generated SDPA kernels, Triton's flex_attention template) and
# the ATen operators that launch them (CPU: _scaled_dot_product_flash_attention_for_cpu).
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cudnn", ("cudnn_attention", "cudnn_generated", "sdpa_cudnn", "cudnn")),
    ("flex", ("flex_attention", "flexattention")),
    ("memory-efficient", ("efficient_attention", "fmha_cutlass", "mem_efficient")),
    ("flash", ("flash_attention", "flash_fwd", "flash_bwd", "flash::")),
    ("math", ("_scaled_dot_product_attention_math",)),
)


def kernel_family(name: str) -> str | None:
    low = name.lower()
    for family, fragments in FAMILIES:
        if any(f in low for f in fragments):
            return family
    return None


@dataclasses.dataclass(frozen=True)
class Shape:
    head_dim: int
    heads: int
    kv_heads: int
    seq_len: int
    dropout: float
    softcap: float
    document_mask: bool

    def label(self) -> str:
        gqa = f"GQA {self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else "MHA"
        extra = (", dropout" if self.dropout else "") + (
            ", documents" if self.document_mask else ""
        )
        return f"head_dim {self.head_dim}, {self.heads} heads ({gqa}), seq {self.seq_len}{extra}"


def shape_of(cfg: Config) -> Shape:
    m = cfg.model
    return Shape(
        m.head_dim,
        m.n_heads,
        m.kv_heads,
        cfg.seq_len,
        m.dropout,
        m.attn_logit_softcap,
        cfg.data.document_mask,
    )


def attention_shapes(extra: tuple[str, ...] = (CHAR_CONFIG.format(theta=10000),)) -> dict:
    """{Shape: [config names]} over configs/paper and the `extra` configs."""
    paths = sorted((REPO / "configs" / "paper").glob("*.yaml")) + [REPO / p for p in extra]
    out: dict[Shape, list[str]] = {}
    for path in paths:
        out.setdefault(shape_of(load_config(path)), []).append(Path(path).stem)
    return out


def predicted_kernel(shape: Shape, device: torch.device, dtype: torch.dtype) -> str:
    """The family torch's documented constraints select (see the module docstring)."""
    if shape.softcap > 0:
        return "unfused"
    if shape.document_mask:
        backend = document_attention_backend(device, shape.head_dim, shape.dropout, shape.softcap)
        if backend == "flex":
            return "flex"
    if device.type != "cuda":
        return "math" if shape.dropout > 0 else "flash"
    low_precision = dtype in (torch.bfloat16, torch.float16)
    major, _ = torch.cuda.get_device_capability(device)
    d8 = shape.head_dim % 8 == 0
    if low_precision and major >= 8 and d8 and shape.head_dim <= 256 and not shape.document_mask:
        return "flash"
    if d8 and shape.kv_heads == shape.heads:
        return "memory-efficient"
    return "math"


def run_shape(shape: Shape, device: torch.device, seq_cap: int | None) -> tuple[set[str], list]:
    """(families seen, the matching names) of one layer's training step at `shape`."""
    seq = min(shape.seq_len, seq_cap or shape.seq_len)
    heads, kv = shape.heads, shape.kv_heads
    if seq_cap:  # the smoke: fewer heads, the same head_dim and kind (GQA or not)
        kv = 1
        heads = 2 if shape.kv_heads != shape.heads else 1
    cfg = ModelConfig(
        vocab_size=128,
        pad_vocab_to_multiple=1,
        n_layers=1,
        d_model=heads * shape.head_dim,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=4 * shape.head_dim,
        max_seq_len=seq,
        dropout=shape.dropout,
        attn_logit_softcap=shape.softcap,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(torch.bfloat16).train()
    x = torch.randint(0, 128, (1, seq), device=device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for _ in range(2):  # the first call selects and loads kernels; the second is profiled
        with profile(activities=activities) as prof:
            model(x, targets=x).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = [e.key for e in prof.key_averages()]
    on_device = [n for n in names if kernel_family(n) and _is_kernel(prof, n)]
    matched = on_device or [n for n in names if kernel_family(n)]
    return {kernel_family(n) for n in matched}, sorted(matched)


def _is_kernel(prof, name: str) -> bool:
    return any(
        e.key == name and e.device_type != torch.autograd.DeviceType.CPU
        for e in prof.key_averages()
    )


def kernels_stage(ctx: Context) -> dict[str, Any]:
    rows, checks = [], []
    dtype = torch.bfloat16
    for shape, configs in attention_shapes().items():
        families, names = run_shape(shape, ctx.device, ctx.sizes.kernel_seq_cap)
        # No SDPA kernel at all: our unfused attention (the soft cap's) ran.
        measured = "+".join(sorted(families)) or "unfused"
        predicted = predicted_kernel(shape, ctx.device, dtype)
        rows.append(
            {
                "shape": shape.label(),
                "configs": configs,
                "head_dim": shape.head_dim,
                "heads": f"{shape.heads}/{shape.kv_heads}",
                "seq_len": shape.seq_len,
                "dropout": shape.dropout,
                "predicted": predicted,
                "measured": measured,
                "kernel_names": [n[:120] for n in names],
            }
        )
        c = check(f"kernel for {shape.label()}", None, None)
        c.update(measured=measured, expected=predicted, flagged=measured != predicted)
        checks.append(c)
    return {"tables": {"kernels": rows}, "checks": checks, "notes": []}


__all__ = [
    "FAMILIES",
    "Shape",
    "attention_shapes",
    "kernel_family",
    "kernels_stage",
    "predicted_kernel",
    "run_shape",
    "shape_of",
]
