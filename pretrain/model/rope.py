"""Rotary position embedding on the first `rotary_dims` dims of each head (partial RoPE).

Convention: GPT-NeoX / Hugging Face "rotate_half". The rotary part of a head is split in
two halves (x1, x2) and rotated as (x1 cos - x2 sin, x2 cos + x1 sin), with inverse
frequencies theta^(-2i / rotary_dims), i = 0 .. rotary_dims/2 - 1. Dims past
`rotary_dims` pass through unchanged; rotary_dims = 0 is NoPE.

One cache per model: cos and sin of shape (max_seq_len, rotary_dims), always fp32, built
once at construction and shared by every layer. Theta only changes the numbers in that
cache, never the work done per step, so no theta can be slower than another.
"""

from __future__ import annotations

import torch
from torch import nn


def inverse_frequencies(rotary_dims: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/rotary_dims) for i in [0, rotary_dims/2), fp32 (computed in fp64)."""
    i = torch.arange(0, rotary_dims, 2, dtype=torch.float64, device=device)
    return (1.0 / (theta ** (i / rotary_dims))).to(torch.float32)


def rope_cache(
    max_seq_len: int, rotary_dims: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, rotary_dims), fp32, halves repeated (rotate_half)."""
    inv_freq = inverse_frequencies(rotary_dims, theta, device)
    pos = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # (T, r/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, r)
    return emb.cos(), emb.sin()


def rope_cache_bytes(max_seq_len: int, rotary_dims: int, bytes_per_element: int = 4) -> int:
    """Bytes of one cos+sin cache: 2 x max_seq_len x rotary_dims x element size."""
    return 2 * max_seq_len * rotary_dims * bytes_per_element


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (..., T, head_dim) by cos/sin (T, r).

    The rotation runs in fp32 (the cache's precision) and the result is cast back to x's
    dtype, so a bf16 model loses no positional precision to a bf16 cache.
    """
    r = cos.shape[-1]
    if r == 0:
        return x
    x_rot = x[..., :r].float()
    out = x_rot * cos + rotate_half(x_rot) * sin
    if r == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the model's one fp32 cos/sin cache; `forward(start, length)` slices it."""

    def __init__(self, rotary_dims: int, max_seq_len: int, theta: float):
        super().__init__()
        self.rotary_dims = rotary_dims
        self.max_seq_len = max_seq_len
        self.theta = theta
        cos, sin = rope_cache(max_seq_len, rotary_dims, theta)
        # Not persistent: derived from the config, so never stored in checkpoints.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) / .half() would cast the cache too; rebuild it in fp32 on the
        # new device instead, from the exact formula (not from the rounded values).
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            cos, sin = rope_cache(self.max_seq_len, self.rotary_dims, self.theta, self.cos.device)
            self.cos, self.sin = cos, sin
        return self

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + length
        if end > self.max_seq_len:
            raise ValueError(
                f"position {end - 1} is past model.max_seq_len={self.max_seq_len}; "
                f"raise model.max_seq_len (the RoPE cache is built for that many positions)"
            )
        return self.cos[start:end], self.sin[start:end]

    def extra_repr(self) -> str:
        return (
            f"rotary_dims={self.rotary_dims}, max_seq_len={self.max_seq_len}, theta={self.theta:g}"
        )
