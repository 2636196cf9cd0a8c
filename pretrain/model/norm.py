"""RMSNorm and LayerNorm, chosen by name."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Llama and HF do)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # The weight meets x's dtype, not the other way round: under autocast (fp32 weights,
        # bf16 activations, as QK-Norm's q and k are) `weight * x` would promote the whole
        # activation back to fp32, and every later op would cast it down again. With weights
        # already in x's dtype (fp32, or DeepSpeed's bf16) both casts are no-ops.
        return xf.to(x.dtype) * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    raise ValueError(f"model.norm={kind!r} is unknown; use 'rmsnorm' or 'layernorm'")
