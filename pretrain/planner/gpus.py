"""The GPUs a plan is made for, and the constants every part of the planner shares."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pretrain.config import ConfigError

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
    memory_bandwidth: float = 3.35e12  # HBM bytes/s (the optimizer step is bound by it)

    @property
    def gib(self) -> float:
        return self.memory / GiB


GPUS = {
    # NVIDIA's datasheets: H100 SXM 3.35 TB/s of HBM3, H200 4.8 TB/s of HBM3e.
    "h100": GPU("H100 SXM 80GB", 81559 * 2**20, 989e12, 3.35e12),
    "h200": GPU("H200 141GB", 143771 * 2**20, 989e12, 4.8e12),
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
