"""RMSNorm and LayerNorm, chosen by name.

RMSNorm runs one of three paths, all computing x / rms(x) * weight in fp32 inside:

    CUDA            torch's fused kernels (`F.rms_norm`: one kernel forward, one backward)
    CPU, training   `_RMSNormFunction`: the forward below, and the closed-form backward
                    (8 full-size kernels where autograd's chain through pow, mean, rsqrt and
                    two products ran about 14; every elementwise kernel is a parallel region
                    on a CPU, which on a busy machine waits for its threads)
    CPU, no graph   the plain expression (`rms_norm_reference`): evaluation and decoding

Numerics. The CPU paths give bit-identical forwards (fp32 and bf16: normalised in fp32, cast
to x's dtype, then times the weight in x's dtype, as Llama and Hugging Face do). The closed-
form backward equals autograd's to rounding: in fp32 within 1e-6 relative of the largest
gradient (measured ~1e-7), in bf16 within one bf16 rounding; it keeps x and the per-row
1/rms for the backward, as torch's fused kernel does (autograd kept x, 1/rms and the
normalised x), so the planner's trace on CPU holds what a GPU keeps. `F.rms_norm` multiplies
the weight in fp32 and rounds once: the same in fp32 (to the kernel's summation order), and
in bf16 within one bf16 rounding of the CPU paths, nearer to fp64 (tests/test_model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight: normalised in fp32, cast back to x's dtype, times the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # The weight meets x's dtype, not the other way round: under autocast (fp32 weights,
    # bf16 activations, as QK-Norm's q and k are) `weight * x` would promote the whole
    # activation back to fp32, and every later op would cast it down again. With weights
    # already in x's dtype (fp32, or DeepSpeed's bf16) both casts are no-ops.
    return xf.to(x.dtype) * weight.to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """`rms_norm_reference` with the closed-form backward. With n = x r (r = 1/rms(x), per
    row), y = n w and the incoming gradient g:

        dw = sum over rows of g n
        dx = r (g w - n mean(g w n))           (the mean over the normalised dim)

    bf16 operands meet fp32 ones inside each kernel (type promotion), and results are
    written in x's dtype by the kernel that computes them: no separate cast kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()  # no copy for fp32 x
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        # The reference's two roundings: x r rounded to x's dtype, times the weight in it.
        return (xf * rstd).to(x.dtype).mul_(weight.to(x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        # One cast of each bf16 operand (none in fp32): on a CPU an operand of another dtype
        # is copied by every kernel that meets it.
        # fp64 stays fp64 (the exactness tests run in it): the weight's gradient sums over
        # every row, where fp32 would round as autograd's chain in fp64 does not.
        ct = torch.promote_types(grad.dtype, torch.float32)
        g, w = grad.to(ct), weight.to(ct)
        # Recomputed (one kernel) rather than kept (a full-size tensor); normalised in fp32
        # as the forward does.
        n = (x.float() * rstd).to(ct)
        gn = g * n
        dw = gn.sum(tuple(range(gn.dim() - 1))) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            c = (gn * w).mean(-1, keepdim=True)
            dx = (g * w).addcmul_(n, c, value=-1).mul_(rstd).to(x.dtype)
        return dx, None if dw is None else dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, on the path for x's device (see the module docstring)."""
    if x.device.type == "cuda":
        # Autocast off: x and the weight meet in x's dtype here, and F.rms_norm computes in
        # fp32 inside; an autocast policy that upcast it would hand bf16 q/k back in fp32.
        with torch.autocast("cuda", enabled=False):
            return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Llama and HF do)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    raise ValueError(f"model.norm={kind!r} is unknown; use 'rmsnorm' or 'layernorm'")
