"""bf16 on the GPU against fp32 on the CPU: the loss and every parameter's gradient of one
small model (Llama-shaped: GQA, 25% RoPE, QK-Norm), the same weights and batch.

Two rows: fp32 on the device (TF32 off: only the kernels' summation order differs from the
CPU) and bf16 weights on the device, as DeepSpeed's BF16 path runs the model. A gradient's
error is ||g - g_ref|| / ||g_ref|| per parameter; the table gives the largest and the median.
The bounds: fp32 within 1e-5 (loss) and 1e-3 (gradients); bf16 within 1e-2 and 0.1
(bf16 keeps 8 bits of mantissa: 2^-8 = 0.4% per rounding, and gradients sum many roundings).
In the smoke the device is the CPU too: the fp32 row is then exact.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.gpucheck.results import at_most
from pretrain.gpucheck.sizes import Context
from pretrain.model.transformer import Transformer

BOUNDS = {"fp32": (1e-5, 1e-3), "bf16": (1e-2, 0.1)}  # (loss, largest gradient error)


def loss_and_grads(model: Transformer, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x, targets=x).loss
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def numerics_stage(ctx: Context) -> dict[str, Any]:
    cfg = ModelConfig(
        **ctx.sizes.numerics_model,
        pad_vocab_to_multiple=1,
        max_seq_len=ctx.sizes.numerics_batch[1],
        rope_fraction=0.25,
        qk_norm=True,
    )
    torch.manual_seed(0)
    reference = Transformer(cfg).train()
    with torch.no_grad():  # norm weights away from one, so a misplaced one shows
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, ctx.sizes.numerics_batch, generator=g)
    ref_loss, ref_grads = loss_and_grads(reference, x)
    rows, checks = [], []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = copy.deepcopy(reference).to(ctx.device, dtype)
            loss, grads = loss_and_grads(model, x.to(ctx.device))
            errors = {
                n: float((grads[n] - r).norm() / r.norm().clamp_min(1e-30))
                for n, r in ref_grads.items()
            }
            worst = max(errors, key=errors.get)
            loss_error = abs(loss - ref_loss) / abs(ref_loss)
            name = f"{precision} on {ctx.device.type} vs fp32 on cpu"
            rows.append(
                {
                    "comparison": name,
                    "loss_reference": ref_loss,
                    "loss": loss,
                    "loss_rel_error": loss_error,
                    "grad_rel_error_max": errors[worst],
                    "grad_rel_error_median": statistics.median(errors.values()),
                    "worst_parameter": worst,
                }
            )
            loss_bound, grad_bound = BOUNDS[precision]
            checks.append(at_most(f"{name}: loss relative error", loss_error, loss_bound))
            checks.append(
                at_most(f"{name}: largest gradient relative error", errors[worst], grad_bound)
            )
            del model
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    notes = [f"model: {reference.num_params():,} parameters, batch {tuple(x.shape)}"]
    return {"tables": {"numerics": rows}, "checks": checks, "notes": notes}
