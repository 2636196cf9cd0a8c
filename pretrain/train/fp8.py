"""FP8 training of the blocks' linear layers through torchao's float8 training (`train.fp8`).

`tensorwise`: one scale per tensor (the fastest recipe on H100/H200); `rowwise`: one scale
per row of each operand (more accurate, keeps the high-precision operands for the backward).
Only the blocks' linears are converted (q/k/v, attention output, MLP in and out), never the
embedding or the output layer, whose softmax is the most sensitive matmul, as torchao's and
torchtitan's recipes advise; and only layers whose two dims are multiples of 16, which the
fp8 GEMM (torch._scaled_mm) requires. The weights themselves stay in the training dtype
(bf16 under DeepSpeed's BF16 engine, fp32 master copies in its optimizer): checkpoints and
exports are those of a bf16 run, and a run may switch fp8 on or off on resume.

fp8 GEMMs need a GPU of compute capability 8.9 or newer (L4, L40, H100, H200). Elsewhere
`train.fp8_emulate: true` runs torchao's emulation: the same casts and scales, the matmul in
high precision, so the CPU suite trains and resumes the fp8 numerics (not its speed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import Any

from torch import nn

from pretrain.config import ConfigError

RECIPES = ("tensorwise", "rowwise")
GEMM_MULTIPLE = 16  # torch._scaled_mm: both dims of each operand divisible by 16


def _torchao_float8() -> Any:
    """torchao.float8, imported quietly: its import logs a warning per CUDA extension it cannot
    load and for a missing Triton (float8 training needs neither)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import torchao.float8 as float8
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return float8


def fp8_layer(module: nn.Module, name: str) -> bool:
    """Whether the module named `name` trains in fp8: a block's linear whose dims fit."""
    return (
        isinstance(module, nn.Linear)
        and name.startswith("blocks.")
        and module.in_features % GEMM_MULTIPLE == 0
        and module.out_features % GEMM_MULTIPLE == 0
    )


def convert_to_fp8(model: nn.Module, recipe: str, emulate: bool) -> list[str]:
    """Swap the model's fp8 layers (fp8_layer) for torchao's Float8Linear in place; their
    names, in order. The parameters are the same tensors: state dicts are unchanged."""
    if recipe not in RECIPES:
        raise ConfigError(f"train.fp8={recipe!r} is unknown; use off, {' or '.join(RECIPES)}")
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    names = [n for n, m in model.named_modules() if fp8_layer(m, n)]
    float8.convert_to_float8_training(model, config=config, module_filter_fn=fp8_layer)
    return names


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of the model's layers that run in fp8 (after convert_to_fp8)."""
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
