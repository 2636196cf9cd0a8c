"""The sizes each mode runs at, and the context every stage receives.

`gpu`: the real figures on one GPU (the paper's 1B configs at seq 2048, full-size peers).
`smoke`: the same code at tiny sizes on CPU (--cpu-smoke): every stage's path runs, in
seconds, so the kit cannot rot between GPU loans. Only the sizes differ between the two;
a stage never asks which mode it is in except through these numbers and `Context.cuda`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.planner.gpus import GPU, GPUS

REPO = Path(__file__).resolve().parents[2]
MEMORY_CONFIGS = ("llama1b_rope10", "pythia1b_rope10")  # configs/paper/NAME.yaml
CHAR_CONFIG = "configs/char/shakespeare_theta{theta:g}.yaml"


@dataclass(frozen=True)
class Sizes:
    mode: str  # "gpu" or "smoke"
    warmup: int  # untimed optimizer steps of a measured run
    timed: int  # timed steps (then one profiled step)
    tiny_model: dict[str, Any] | None  # model overrides for the paper configs (smoke)
    micro_batch_cap: int | None  # the largest micro batch the planner may pick (smoke)
    peers: dict[str, Any]  # tools/benchmark.py peers' arguments
    kernel_seq_cap: int | None  # attention shapes at most this long (smoke)
    numerics_model: dict[str, Any]
    numerics_batch: tuple[int, int]  # (sequences, tokens)
    science: dict[str, Any]  # seeds, overrides of the char config, generation sizes
    positions: dict[str, Any]  # the position-encoding variants' model, batch, window, rounds
    fp8: dict[str, Any]  # the fp8 stage's model (Llama-8B's width), batch, rounds
    # torch.compile's backend for train.compile and the peers' compiled model: inductor on a
    # GPU; in the smoke dynamo's "eager" (the graph is captured, no code is generated: a
    # CPU inductor build takes minutes on 2 cores; tests/test_model_compile.py covers it)
    compile_backend: str = "inductor"


GPU_SIZES = Sizes(
    mode="gpu",
    warmup=2,
    timed=3,
    tiny_model=None,
    micro_batch_cap=None,
    # Each paper shape at its 1B width with 8 of its 16 blocks (llama1b: 32/8 heads of 64,
    # SwiGLU 8192; pythia1b: 8 heads of 256, GeLU 8192, 25% RoPE; peer_models.SHAPES): ours,
    # transformers' and litgpt's, eager and compiled (six models with their AdamW states) fit
    # an H100 beside each other in bf16 weights (the paired rounds keep all of them alive).
    # precision: "bf16" = bf16 weights as DeepSpeed holds them; "autocast" = the old mode.
    peers=dict(
        d_model=2048,
        layers=8,
        vocab=50304,
        batch=4,
        seq_len=2048,
        bf16_seq_len=2048,
        rounds=10,
        bf16_rounds=10,
        warmup=2,
        compile=True,
        precision="bf16",
    ),
    kernel_seq_cap=None,
    numerics_model=dict(
        vocab_size=1024, n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, d_ff=704
    ),
    numerics_batch=(4, 256),
    science=dict(seeds=(1, 2, 3), overrides=(), gen_tokens=200, gen_rounds=10),
    # llama1b's width and heads, 4 of its blocks (attention is per block: more add nothing)
    positions=dict(
        vocab=1024,
        layers=4,
        d_model=2048,
        heads=32,
        kv_heads=8,
        d_ff=8192,
        batch=4,
        seq_len=2048,
        window=512,
        warmup=2,
        rounds=5,
    ),
    # Llama-3.1-8B's width and heads, 2 of its blocks
    fp8=dict(
        vocab=1024,
        layers=2,
        d_model=4096,
        heads=32,
        kv_heads=8,
        d_ff=14336,
        batch=2,
        seq_len=4096,
        warmup=2,
        rounds=5,
    ),
)

SMOKE_SIZES = Sizes(
    mode="smoke",
    warmup=0,
    timed=1,
    tiny_model=dict(n_layers=1, d_model=64, n_heads=4, d_ff=128, vocab_size=256),
    micro_batch_cap=2,
    peers=dict(
        d_model=64,
        layers=1,
        heads=4,  # llama1b: GQA 4/1; pythia1b: MHA, head_dim 16, 4 rotary dims
        vocab=128,
        batch=1,
        seq_len=16,
        bf16_seq_len=16,
        rounds=1,
        bf16_rounds=1,
        warmup=1,
        # dynamo's tracing of three models takes ~15 s a shape on 2 cores: the compiled path
        # is tested in tests/test_benchmark_peers.py (both shapes, dynamo's "eager" backend)
        compile=False,
        precision="bf16",
    ),
    kernel_seq_cap=32,
    numerics_model=dict(vocab_size=128, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64),
    numerics_batch=(2, 16),
    science=dict(
        seeds=(1,),
        overrides=(
            "model.n_layers=1",
            "model.d_model=32",
            "model.n_heads=2",
            "model.d_ff=64",
            "model.max_seq_len=32",
            "train.seq_len=32",
            "train.train_iters=4",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            "train.eval_interval=2",
            "train.eval_iters=1",
            "schedule.warmup_steps=1",
            "logging.log_interval=1",
            "logging.tensorboard=false",
            "logging.sample_prompts=[]",
        ),
        gen_tokens=4,
        gen_rounds=1,
    ),
    positions=dict(
        vocab=64,
        layers=2,
        d_model=64,  # head dim 16: 10% RoPE keeps 2 rotary dims
        heads=4,
        kv_heads=2,
        d_ff=128,
        batch=1,
        seq_len=32,
        window=8,
        warmup=0,
        rounds=1,
    ),
    fp8=dict(
        vocab=64,
        layers=1,
        d_model=64,
        heads=4,
        kv_heads=2,
        d_ff=128,
        batch=1,
        seq_len=32,
        warmup=1,
        rounds=1,
    ),
    compile_backend="eager",
)


def blocks_model(sizes: dict[str, Any], **fields: Any) -> ModelConfig:
    """The few-block model a kernel-level stage (positions, fp8) times, from its sizes entry
    (vocab, layers, d_model, heads, kv_heads, d_ff, seq_len) and the variant's `fields`."""
    return ModelConfig(
        vocab_size=sizes["vocab"],
        pad_vocab_to_multiple=1,
        n_layers=sizes["layers"],
        d_model=sizes["d_model"],
        n_heads=sizes["heads"],
        n_kv_heads=sizes["kv_heads"],
        d_ff=sizes["d_ff"],
        max_seq_len=sizes["seq_len"],
        **fields,
    )


def timed_step(
    model: torch.nn.Module, x: torch.Tensor, device: torch.device
) -> tuple[float, float]:
    """(seconds, loss) of one forward + backward of `model` on `x`, the device synchronised
    on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss = model(x, targets=x).loss
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, float(loss.detach())


def smoke_model_overrides(model: ModelConfig, tiny: dict[str, Any], seq: int) -> list[str]:
    """--set overrides that shrink a paper config's model and sequence for the smoke, keeping
    its kind: GQA stays GQA (half as many kv heads), MHA stays MHA."""
    out = [f"model.{k}={v}" for k, v in tiny.items()]
    gqa = model.n_kv_heads is not None and model.n_kv_heads != model.n_heads
    out.append(f"model.n_kv_heads={tiny['n_heads'] // 2 if gqa else 'null'}")
    out += [f"model.max_seq_len={seq}", f"train.seq_len={seq}"]
    return out


@dataclass
class Context:
    """What a stage gets: where to write, the device, the sizes, the planner's GPU, the time
    it must end by (monotonic seconds), and its own result of an earlier call (chunked
    stages continue from it)."""

    sizes: Sizes
    device: torch.device
    folder: Path
    gpu: GPU  # the planner's view of this device
    target: str  # "cuda" or "cpu": which kernels the plan traces
    deadline: float
    previous: dict[str, Any] = field(default_factory=dict)
    shakespeare: Path | None = None
    log: Callable[[str], None] = print

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def this_gpu(device: torch.device) -> tuple[GPU, str]:
    """(the planner's GPU for this device, the plan's kernel target). A CUDA device is
    planned with its reported memory and the peak of the known GPU its name matches (989
    TFLOP/s dense BF16 for both H100 and H200); the smoke plans a CPU with 8 GiB."""
    if device.type != "cuda":
        return GPU("CPU (smoke)", 8 * 2**30, 1e12), "cpu"
    props = torch.cuda.get_device_properties(device)
    known = next((g for k, g in GPUS.items() if k in props.name.lower()), None)
    return GPU(props.name, props.total_memory, known.peak_flops if known else 989e12), "cuda"
