"""Which attention kernel runs: read from the profiler's kernel and operator names, for every
attention shape of configs/paper (and the character-level study's), against the kernel
torch selects.

Predicted (`predicted_kernel`). Our model's own switches come first: an attention-logit
soft cap runs our unfused path; a document mask runs FlexAttention or the masked SDPA
(pretrain/model/document_attention.py: `document_attention_backend`). On CPU torch's flash
kernel runs unless attention dropout is on (then the math path). On CUDA,
`F.scaled_dot_product_attention` walks a priority order of backends and takes the first
whose checks pass (`select_sdp_backend` in torch's
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp). On a GPU the prediction is torch's
own selection for the shape (`torch._fused_sdp_choice`, the call SDPA makes); given a
device's facts instead (compute capability, cuDNN and torch versions), it applies the rules
below: read from that file (and sdp_utils_cpp.h) in torch's main at commit 001f694, and
where the releases differ from main, from the compiled v2.11.0, v2.12.0 and v2.13.0 cu130
builds (libtorch_cuda.so: each `can_use_*`'s list of checks and their version constants).
They are those releases' rules; `kernels_stage` compares them with torch's own selection
on the GPU, so a later torch that changes them is flagged. Training is assumed (inputs
that require grad), as the measured step is one. On the H200 (torch 2.11.0+cu130, cuDNN
9.19.0) torch's selection matched these rules for 14 shapes (those of the run, fp32,
head_dim 192 and 512, GQA, dropout, a mask).

- Priority (`priority_order`, `check_prefer_cudnn_attention`; default in ATen/Context.h):
  cuDNN, flash, memory-efficient, math when the runtime cuDNN is newer than 9.15.0 (its fix
  for sequence lengths not a multiple of 128) on sm9x/sm10x with minor 0 or 3 (2.13's
  CUDA 13 builds drop the minor condition), unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1;
  otherwise flash, memory-efficient, math, cuDNN. `torch._C._get_sdp_priority_order()`
  reads the order (it is set at the first SDPA call on CUDA); `sdpa_kernel(...,
  set_priority=True)` changes it.
- cuDNN (`can_use_cudnn_attention`, `check_cudnn_tensor_shapes`): sm80-sm121, fp16/bf16,
  cuDNN 9; head_dim a multiple of 8, at most 256 on sm90 with cuDNN >= 9.10 and 128
  elsewhere; GQA when the query heads are a multiple of the kv heads (`enable_gqa`);
  causal and a (B, 1, T, T) mask both taken; key length not 1; dropout except on cuDNN
  9.11.1-9.13, and from torch 2.12 (`check_cudnn_dropout`) only a multiple of 1/16. Not in
  torch's deterministic mode.
- FlashAttention-2 (`can_use_flash_attention`): sm80-sm121, fp16/bf16, head_dim at most
  256, no mask, GQA; training on sm86-89 and sm120-121 takes head_dim <= 192, or > 224
  without dropout.
- Memory-efficient (`can_use_mem_efficient_attention`): sm50-sm121, fp16/fp32 (and bf16 on
  sm80+), head_dim a multiple of 8 in half precision (4 in fp32 on sm80+), masks, no GQA.
- Math: always.

torch's main after 2.13 allows head_dim 256 in cuDNN only above cuDNN 9.22.0 with cuDNN
frontend 1.24 (and checks the backward's head dims): with cuDNN 9.19 or 9.20 (what the
2.11 and 2.13 wheels pin) such a torch runs flash at head_dim 256 on sm90.

Memory: the planner's GPU memory assumes FlashAttention-2's allocations
(pretrain/planner/__init__.py): the output and a log-sum-exp per row saved for the
backward, no T x T scores. cuDNN's fused attention keeps the same statistics: on the H200
run (torch 2.11, cuDNN 9.19) cuDNN attention ran for every shape and the measured
allocated peaks matched the plan within 1-4%, so for planning its memory is flash's.

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
from torch.nn.attention import SDPBackend
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


# Our family name of each of torch's SDPA backends (torch.nn.attention.SDPBackend's values).
BACKEND_FAMILIES: dict[int, str] = {
    int(SDPBackend.CUDNN_ATTENTION): "cudnn",
    int(SDPBackend.FLASH_ATTENTION): "flash",
    int(SDPBackend.EFFICIENT_ATTENTION): "memory-efficient",
    int(SDPBackend.MATH): "math",
}
# torch's default order (ATen/Context.h `sdp_priority_order`), and the one `priority_order`
# installs when `check_prefer_cudnn_attention` holds.
DEFAULT_PRIORITY = ("flash", "memory-efficient", "math", "cudnn")
CUDNN_FIRST = ("cudnn", "flash", "memory-efficient", "math")
HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The facts besides the shape that torch's choice depends on: the device's compute
    capability, the runtime cuDNN (`torch.backends.cudnn.version()`: 9.19.0 is 91900) and
    torch's (major, minor)."""

    capability: tuple[int, int]
    cudnn: int
    torch: tuple[int, int]


def predicted_kernel(
    shape: Shape,
    device: torch.device,
    dtype: torch.dtype,
    *,
    capability: tuple[int, int] | None = None,
    cudnn_version: int | None = None,
    torch_version: tuple[int, int] | None = None,
    priority: tuple[str, ...] | None = None,
) -> str:
    """The family that runs a training step's attention at `shape` (see the module
    docstring). On CUDA with none of the keywords given and a GPU here: torch's own
    selection. Otherwise torch's rules, with the given facts and the rest read from this
    machine; `priority` (families, torch's order by default) stands for an order set by
    `sdpa_kernel(..., set_priority=True)` or TORCH_CUDNN_SDPA_DEPRIORITIZED."""
    if shape.softcap > 0:
        return "unfused"
    if shape.document_mask:
        backend = document_attention_backend(device, shape.head_dim, shape.dropout, shape.softcap)
        if backend == "flex":
            return "flex"
    if device.type != "cuda":
        return "math" if shape.dropout > 0 else "flash"
    facts = (capability, cudnn_version, torch_version, priority)
    if all(f is None for f in facts) and torch.cuda.is_available():
        return torch_selection(shape, device, dtype)
    runtime = _runtime(device, capability, cudnn_version, torch_version)
    order = _checked_priority(priority) if priority is not None else torch_priority(runtime)
    return next(b for b in order if _USABLE[b](shape, dtype, runtime))


def torch_selection(shape: Shape, device: torch.device, dtype: torch.dtype) -> str:
    """torch's choice on this GPU: `torch._fused_sdp_choice` is the selection SDPA makes
    (`select_sdp_backend`: torch's priority order, then each backend's checks, which the
    public `torch.backends.cuda.can_use_*_attention` run one by one), on empty q, k, v laid
    out as our attention passes them ((B, H, T, D) views of (B, T, H, D)) that require grad."""
    t, d = shape.seq_len, shape.head_dim

    def heads(n: int) -> torch.Tensor:
        x = torch.empty(1, t, n, d, device=device, dtype=dtype, requires_grad=True)
        return x.transpose(1, 2)

    mask = None
    if shape.document_mask:  # the masked SDPA's (B, 1, T, T) boolean mask
        mask = torch.ones(1, 1, t, t, device=device, dtype=torch.bool).tril()
    with torch.enable_grad():  # the checks of a training step, whatever the caller's mode
        q, kv = heads(shape.heads), heads(shape.kv_heads)
        choice = torch._fused_sdp_choice(
            q, kv, kv, mask, shape.dropout, mask is None, enable_gqa=shape.kv_heads != shape.heads
        )
    return BACKEND_FAMILIES[choice]


def torch_priority(runtime: Runtime) -> tuple[str, ...]:
    """torch's default order (`check_prefer_cudnn_attention`): cuDNN first from cuDNN 9.15.1
    on sm9x/sm10x, whose minor must be 0 or 3 before torch 2.13 (2.13's CUDA 13 builds,
    our wheels, dropped that; its CUDA 12 builds keep it)."""
    major, minor = runtime.capability
    prefer = (
        runtime.cudnn > 91500 and major in (9, 10) and (minor in (0, 3) or runtime.torch >= (2, 13))
    )
    return CUDNN_FIRST if prefer else DEFAULT_PRIORITY


def _runtime(
    device: torch.device,
    capability: tuple[int, int] | None,
    cudnn_version: int | None,
    torch_version: tuple[int, int] | None,
) -> Runtime:
    if capability is None:
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here to read the capability of: pass capability")
        capability = torch.cuda.get_device_capability(device)
    if cudnn_version is None:
        cudnn_version = torch.backends.cudnn.version()
        if cudnn_version is None:
            raise ValueError("this torch has no cuDNN to read the version of: pass cudnn_version")
    if torch_version is None:
        torch_version = tuple(int(p) for p in torch.__version__.split(".")[:2])
    if len(capability) != 2 or len(torch_version) != 2:
        raise ValueError(
            f"capability {capability} and torch_version {torch_version}: (major, minor)"
        )
    return Runtime(tuple(capability), int(cudnn_version), tuple(torch_version))


def _checked_priority(priority: tuple[str, ...]) -> tuple[str, ...]:
    # torch's order always holds every backend, so some backend (math) always takes the shape.
    if sorted(priority) != sorted(DEFAULT_PRIORITY):
        raise ValueError(f"priority {priority}: an order of all of {DEFAULT_PRIORITY}")
    return tuple(priority)


def _sm_in(runtime: Runtime, low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= runtime.capability <= high  # check_sm_version: inclusive


def _gqa_ok(shape: Shape) -> bool:
    # check_grouped_query_attention: the query heads a multiple of the kv heads (k and v
    # have the same here); without GQA the counts are equal, which this also holds.
    return shape.heads % shape.kv_heads == 0


def _cudnn_ok(shape: Shape, dtype: torch.dtype, runtime: Runtime) -> bool:
    """can_use_cudnn_attention, for dense inputs (check_cudnn_tensor_shapes for the sizes)."""
    v, dropout = runtime.cudnn, shape.dropout
    # head_dim 256 on sm90 only (capability (9, 0) exactly) from cuDNN 9.10
    limit = 256 if runtime.capability == (9, 0) and v >= 91000 else 128
    # torch 2.12's check_cudnn_dropout: cuDNN's dropout resolution is 1/16
    dropout_ok = not (dropout > 0 and 91100 < v < 91400) and (
        runtime.torch < (2, 12) or (dropout * 16).is_integer()
    )
    return (
        _sm_in(runtime, (8, 0), (12, 1))
        and dtype in HALF
        and v >= 90000  # cuDNN 9: torch has no cuDNN attention with an older one
        and dropout_ok
        and shape.head_dim % 8 == 0
        and shape.head_dim <= limit
        and shape.seq_len > 1  # no key length 1
        and _gqa_ok(shape)
    )


def _flash_ok(shape: Shape, dtype: torch.dtype, runtime: Runtime) -> bool:
    """can_use_flash_attention, for dense inputs."""
    return (
        _sm_in(runtime, (8, 0), (12, 1))
        and dtype in HALF
        and not shape.document_mask  # check_for_attn_mask: flash takes no mask
        and shape.head_dim <= 256
        and _flash_backward_ok(shape, runtime)
        and _gqa_ok(shape)
    )


def _flash_backward_ok(shape: Shape, runtime: Runtime) -> bool:
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: flash's backward
    # raises for these head dims on those GPUs, so training refuses them up front.
    if not (_sm_in(runtime, (8, 6), (8, 9)) or _sm_in(runtime, (12, 0), (12, 1))):
        return True
    return shape.head_dim <= 192 or (shape.dropout == 0 and shape.head_dim > 224)


def _efficient_ok(shape: Shape, dtype: torch.dtype, runtime: Runtime) -> bool:
    """can_use_mem_efficient_attention, for dense inputs: no GQA in torch 2.11-2.13
    (check_batch_size_and_num_heads_dense<false>)."""
    major = runtime.capability[0]
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if major >= 8 else ())
    return (
        _sm_in(runtime, (5, 0), (12, 1))
        and dtype in dtypes
        and shape.head_dim % _gemm_alignment(dtype, major) == 0
        and shape.kv_heads == shape.heads
    )


def _gemm_alignment(dtype: torch.dtype, major: int) -> int:
    # minimum_gemm_alignment: 128 bits where tensor cores run (sm80+, or half on sm70+),
    # else 4 elements from sm80 and 1 below.
    if dtype in HALF and major >= 7:
        return 8
    return 4 if major >= 8 else 1


_USABLE = {
    "cudnn": _cudnn_ok,
    "flash": _flash_ok,
    "memory-efficient": _efficient_ok,
    "math": lambda shape, dtype, runtime: True,
}


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
    """Each shape's measured kernel against torch's selection; on a GPU also the rules (with
    this GPU's capability, cuDNN and torch) against that selection, so a torch whose rules
    moved is flagged."""
    rows, checks = [], []
    dtype = torch.bfloat16
    for shape, configs in attention_shapes().items():
        families, names = run_shape(shape, ctx.device, ctx.sizes.kernel_seq_cap)
        # No SDPA kernel at all: our unfused attention (the soft cap's) ran.
        measured = "+".join(sorted(families)) or "unfused"
        predicted = predicted_kernel(shape, ctx.device, dtype)
        row = {
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
        checks.append(_same(f"kernel for {shape.label()}", measured, predicted))
        if ctx.device.type == "cuda":
            capability = torch.cuda.get_device_capability(ctx.device)
            row["rules"] = predicted_kernel(shape, ctx.device, dtype, capability=capability)
            checks.append(_same(f"kernel rules for {shape.label()}", row["rules"], predicted))
        rows.append(row)
    return {"tables": {"kernels": rows}, "checks": checks, "notes": []}


def _same(name: str, measured: str, expected: str) -> dict[str, Any]:
    c = check(name, None, None)
    c.update(measured=measured, expected=expected, flagged=measured != expected)
    return c
