"""Rotary position embedding on the first `rotary_dims` dims of each head (partial RoPE).

Convention: GPT-NeoX / Hugging Face "rotate_half". The rotary part of a head is split in
two halves (x1, x2) and rotated as (x1 cos - x2 sin, x2 cos + x1 sin), with inverse
frequencies theta^(-2i / rotary_dims), i = 0 .. rotary_dims/2 - 1. Dims past
`rotary_dims` pass through unchanged; rotary_dims = 0 is NoPE.

One cache per model: cos and sin of shape (max_seq_len, rotary_dims), always fp32, built
once at construction and shared by every layer. Theta only changes the numbers in that
cache, never the work done per step, so no theta can be slower than another.

Past max_seq_len the cache grows on demand, by the same formula (the first max_seq_len rows
stay bit-identical), so RoPE, partial RoPE and NoPE evaluate at any length.

Scaling (`model.rope_scaling`, config.RopeScalingConfig) changes the inverse frequencies of
the rotary dims, and for YaRN multiplies cos and sin by an attention factor; the formulas are
transformers' (modeling_rope_utils) with `dim` = the rotary dims, as transformers computes
them for a partial_rotary_factor. The dims past rotary_dims are never touched: they carry no
position, so there is nothing to interpolate; and YaRN's attention factor, applied through
cos and sin, scales the rotary dims' share of q.k by attention_factor^2 and leaves the
pass-through dims' share as it was (in transformers as here). With 10% RoPE that factor
reaches a tenth of each head's logits, not all of it: a partial-RoPE model gets a gentler
temperature change than a full-RoPE one at the same factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.model.config import ModelConfig, RopeScalingConfig


def inverse_frequencies(
    rotary_dims: int, theta: float, device=None, spectrum_dims: int | None = None
) -> torch.Tensor:
    """theta^(-2i/d) for i in [0, rotary_dims/2), fp32 (computed in fp64); d = rotary_dims
    (NeoX's spectrum, rescaled over the rotary dims) or `spectrum_dims` = head_dim (p-RoPE:
    the rotary_dims/2 highest frequencies of full RoPE, the lowest dropped)."""
    i = torch.arange(0, rotary_dims, 2, dtype=torch.float64, device=device)
    return (1.0 / (theta ** (i / (spectrum_dims or rotary_dims)))).to(torch.float32)


def _frequencies64(rotary_dims: int, theta: float, device=None) -> torch.Tensor:
    i = torch.arange(0, rotary_dims, 2, dtype=torch.float64, device=device)
    return 1.0 / (theta ** (i / rotary_dims))


def yarn_attention_factor(s: RopeScalingConfig) -> float:
    """YaRN's cos/sin multiplier: the configured one, else 0.1 ln(factor) + 1 (1 at factor 1)."""
    if s.attention_factor is not None:
        return float(s.attention_factor)
    return 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0


def _yarn_frequencies64(r: int, theta: float, s: RopeScalingConfig, original: int, device=None):
    """transformers' _compute_yarn_parameters, in fp64: frequencies that turn fewer than
    beta_slow times over the original length are interpolated (/ factor), those that turn
    more than beta_fast times are kept, a linear ramp over the dims between."""

    def correction_dim(rotations: float) -> float:
        return (r * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: interpolated
    extrapolated = _frequencies64(r, theta, device)
    return extrapolated / s.factor * (1 - keep) + extrapolated * keep


def _llama3_frequencies64(r: int, theta: float, s: RopeScalingConfig, original: int, device=None):
    """transformers' _compute_llama3_parameters, in fp64: wavelengths longer than
    original / low_freq_factor are interpolated (/ factor), shorter than
    original / high_freq_factor kept, and between them a blend linear in original / wavelength."""
    inv = _frequencies64(r, theta, device)
    wavelength = 2 * math.pi / inv
    smooth = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelength > original / s.low_freq_factor, inv / s.factor, inv)
    middle = (wavelength >= original / s.high_freq_factor) & (
        wavelength <= original / s.low_freq_factor
    )
    return torch.where(middle, blended, out)


def scaled_frequencies(
    rotary_dims: int,
    theta: float,
    scaling: RopeScalingConfig | None = None,
    original_len: int | None = None,
    seq_len: int | None = None,
    device=None,
    spectrum_dims: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, fp32 computed in fp64; the factor cos and sin are multiplied by).

    `original_len`: the trained length (scaling.original_max_seq_len wins when set);
    `seq_len`: the current sequence's length, which only dynamic_ntk reads. No scaling, or a
    factor of 1, is `inverse_frequencies` itself, so the cache stays bit-identical.
    """
    r = rotary_dims
    if scaling is None or scaling.factor == 1.0 or r == 0:
        return inverse_frequencies(r, theta, device, spectrum_dims), 1.0
    if spectrum_dims not in (None, r):
        raise ValueError("rope_scaling of a p-RoPE spectrum is not supported")
    f = scaling.factor
    original = scaling.original_max_seq_len or original_len
    if scaling.type in ("yarn", "dynamic_ntk", "llama3") and not original:
        raise ValueError(f"rope_scaling {scaling.type} needs the original (trained) length")
    factor = 1.0
    if scaling.type == "linear":  # position interpolation: every position / factor
        inv = _frequencies64(r, theta, device) / f
    elif scaling.type == "ntk":  # NTK-aware: the base grows so the lowest frequency / factor
        inv = _frequencies64(r, theta * f ** (r / (r - 2)), device)
    elif scaling.type == "dynamic_ntk":  # ntk with a factor that grows with the sequence
        length = seq_len or original
        if length <= original:
            return inverse_frequencies(r, theta, device), 1.0
        inv = _frequencies64(
            r, theta * ((f * length / original) - (f - 1)) ** (r / (r - 2)), device
        )
    elif scaling.type == "yarn":
        inv = _yarn_frequencies64(r, theta, scaling, original, device)
        factor = yarn_attention_factor(scaling)
    elif scaling.type == "llama3":
        inv = _llama3_frequencies64(r, theta, scaling, original, device)
    else:
        raise ValueError(f"unknown rope_scaling type {scaling.type!r}")
    return inv.to(torch.float32), factor


def rope_cache(
    max_seq_len: int,
    rotary_dims: int,
    theta: float,
    device=None,
    scaling: RopeScalingConfig | None = None,
    original_len: int | None = None,
    seq_len: int | None = None,
    spectrum_dims: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, rotary_dims), fp32, halves repeated (rotate_half)."""
    inv_freq, factor = scaled_frequencies(
        rotary_dims, theta, scaling, original_len, seq_len, device, spectrum_dims
    )
    pos = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # (T, r/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, r)
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def rope_cache_bytes(max_seq_len: int, rotary_dims: int, bytes_per_element: int = 4) -> int:
    """Bytes of one cos+sin cache: 2 x max_seq_len x rotary_dims x element size."""
    return 2 * max_seq_len * rotary_dims * bytes_per_element


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out[..., :r] = x (..., r) rotated by cos/sin (..., r), cast to out's dtype as written.

    With xc = x cos and xs = x sin (cos and sin repeat their halves), the halves are
    x1 cos - x2 sin = xc1 - xs2 and x2 cos + x1 sin = xc2 + xs1: the same products and sums,
    rounded the same way, as x cos + rotate_half(x) sin, in 4 kernels instead of 5 and with no
    concatenation (on CPU every elementwise kernel is a parallel region, and on a busy machine
    each one waits for its threads)."""
    h = x.shape[-1] // 2
    xc, xs = x * cos, x * sin
    torch.sub(xc[..., :h], xs[..., h:], out=out[..., :h])
    torch.add(xc[..., h:], xs[..., :h], out=out[..., h : 2 * h])


class _ApplyRope(torch.autograd.Function):
    """RoPE with a hand-written backward (the transposed rotation), writing each result once
    into a tensor of x's dtype. The autograd graph of the plain expression made, per call, an
    fp32 copy of x's rotary part and a cast back in the forward, the same pair for the
    gradient, a negated half and two concatenations (rotate_half, then the pass-through
    dims): 3-4 full-size temporaries and 4 casts per q or k in a bf16 step. Here: one fp32
    copy of the rotary part each way (so bf16 still rotates in fp32), no concatenation.
    Bit-identical to the plain expression in fp32 and in bf16, values and gradients
    (tests/test_model_rope.py)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        r = cos.shape[-1]
        # Memory layouts as the plain expression's (a full rotation keeps x's strides, the
        # concatenation of a partial one is contiguous): later reductions sum in that order.
        out = torch.empty_like(x) if r == x.shape[-1] else x.new_empty(x.shape)
        if r < x.shape[-1]:
            out[..., r:] = x[..., r:]
        _rotate_into(out, x[..., :r].float(), cos, sin)  # .float(): no copy for fp32 x
        if keep is not None:  # a pair selection: the other pairs as they came, in place
            torch.where(keep, out, x, out=out)
        ctx.save_for_backward(cos, sin, keep)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin, keep = ctx.saved_tensors
        r = cos.shape[-1]
        # The inverse rotation is the rotation by -sin: x1 = g1 cos + g2 sin, x2 = g2 cos -
        # g1 sin, the same products and sums autograd formed through rotate_half.
        dx = grad.new_empty(grad.shape)  # contiguous, as autograd's slice backward made it
        if r < grad.shape[-1]:
            dx[..., r:] = grad[..., r:]
        _rotate_into(dx, grad[..., :r].float(), cos, -sin)
        if keep is not None:  # a pass-through pair's gradient is the one that came
            torch.where(keep, dx, grad, out=dx)
        return dx, None, None, None


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (..., T, head_dim) by cos/sin (T, r).

    The rotation runs in fp32 (the cache's precision) and the result is cast back to x's
    dtype, so a bf16 model loses no positional precision to a bf16 cache. Same numbers as
    `x_rot * cos + rotate_half(x_rot) * sin` on x_rot = x[..., :r].float(), concatenated with
    the dims past r (`apply_rope_reference`), with fewer copies (`_ApplyRope`).

    `keep` (a pair selection, model.rope_pairs): a bool (heads, 1, head_dim) mask of the
    dims that rotate, with cos/sin of the whole head; the other dims keep x's values
    exactly. One rotation of the whole head and one in-place select: the cost of full RoPE
    plus a pass over q and k, with no per-head cos/sin table.
    """
    if cos.shape[-1] == 0:
        return x
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad):
        # Inference (evaluation, decoding): the plain expression, the same numbers. The
        # Function pays off through what it saves for the backward; without one, evaluation
        # and generation run exactly the code they ran before it. Under torch.compile too:
        # dynamo cannot trace the Function's writes into slices (`out=` a non-contiguous
        # view), so it broke the graph twice a layer; inductor fuses the plain expression
        # and its autograd backward into a kernel each way, which is what the Function
        # does by hand.
        return apply_rope_reference(x, cos, sin, keep)
    return _ApplyRope.apply(x, cos, sin, keep)


def apply_rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain autograd expression `apply_rope` equals (kept as the tests' reference)."""
    r = cos.shape[-1]
    if r == 0:
        return x
    x_rot = x[..., :r].float()
    out = x_rot * cos + rotate_half(x_rot) * sin
    if keep is not None:
        return torch.where(keep, out.to(x.dtype), x)
    if r == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the model's one fp32 cos/sin cache; `forward(start, length)` slices it.

    The cache covers max_seq_len positions and grows (doubling, by the same formula) when a
    longer sequence comes: evaluation past the training length. dynamic_ntk's frequencies
    depend on the sequence's length, so past the original length they are computed for each
    forward from its end position (stateless: a later shorter sequence gets its own, unlike
    transformers, which keeps the longest it has seen until a sequence is shorter than the
    original length).
    """

    def __init__(
        self,
        rotary_dims: int,
        max_seq_len: int,
        theta: float,
        scaling: RopeScalingConfig | None = None,
        original_len: int | None = None,
        spectrum_dims: int | None = None,
    ):
        super().__init__()
        self.rotary_dims = rotary_dims
        # None: NeoX's frequencies over the rotary dims; head_dim: p-RoPE's (inverse_frequencies)
        self.spectrum_dims = spectrum_dims
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        self.original_len = original_len or max_seq_len
        cos, sin = self._build(max_seq_len)
        # Not persistent: derived from the config, so never stored in checkpoints.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> RotaryEmbedding:
        return cls(
            cfg.rope_dims,
            cfg.max_seq_len,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.original_max_seq_len,
            spectrum_dims=cfg.head_dim if cfg.rope_spectrum == "p_rope" else None,
        )

    @property
    def dynamic(self) -> bool:
        s = self.scaling
        return s is not None and s.type == "dynamic_ntk" and s.factor != 1.0

    def _build(self, length: int, device=None, seq_len: int | None = None):
        return rope_cache(
            length,
            self.rotary_dims,
            self.theta,
            device,
            scaling=self.scaling,
            original_len=self.original_len,
            seq_len=seq_len,
            spectrum_dims=self.spectrum_dims,
        )

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) / .half() would cast the cache too; rebuild it in fp32 on the
        # new device instead, from the exact formula (not from the rounded values).
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self._build(self.cos.shape[0], self.cos.device)
        return self

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + length
        if self.dynamic and end > self.original_len:
            cos, sin = self._build(end, self.cos.device, seq_len=end)
            return cos[start:end], sin[start:end]
        if end > self.cos.shape[0]:
            self.cos, self.sin = self._build(max(end, 2 * self.cos.shape[0]), self.cos.device)
        return self.cos[start:end], self.sin[start:end]

    def at(
        self, position_ids: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, 1, T, r) of each token's own position (position_ids (B, T)), for
        positions that restart at each packed document; the heads dim broadcasts. The rows
        are the cache's (grown to the largest position, `max_position` if the caller knows
        it, as needed); dynamic_ntk uses the frequencies of the sequence's length, as
        `forward` does."""
        if max_position is None:
            max_position = int(position_ids.max())
        length = max(position_ids.shape[-1], max_position + 1)
        cos, sin = self.forward(0, length)
        return cos[position_ids][:, None], sin[position_ids][:, None]

    def extra_repr(self) -> str:
        s = self.scaling
        scaled = f", scaling={s.type} x{s.factor:g}" if s is not None and s.factor != 1 else ""
        spectrum = f", p_rope over {self.spectrum_dims}" if self.spectrum_dims else ""
        return (
            f"rotary_dims={self.rotary_dims}, max_seq_len={self.max_seq_len}, "
            f"theta={self.theta:g}{scaled}{spectrum}"
        )
