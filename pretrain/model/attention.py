"""Causal self-attention: MHA or GQA, optional QK-Norm, partial RoPE, full or sliding
window, ALiBi, SDPA or FlexAttention, KV cache.

The kernel is chosen in one place, `choose_kernel`, and run by one entry point, `attend`;
the model calls nothing else to attend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.document_attention import (
    DocumentMask,
    dense_position_mask,
    document_attention_backend,
    flex_document_attention,
)
from pretrain.model.norm import make_norm
from pretrain.model.position import LayerPosition, alibi_slopes, layer_positions
from pretrain.model.rope import apply_rope
from pretrain.schema import ConfigError

# The signature of F.scaled_dot_product_attention: (q, k, v, attn_mask=, dropout_p=,
# is_causal=, scale=, enable_gqa=) -> (B, H, T, D).
AttentionFn = Callable[..., torch.Tensor]

Kernel = Literal["sdpa", "flex", "injected", "unfused"]


class KVCache:
    """Keys and values of every layer for incremental decoding.

    Keys are stored after RoPE, so each is rotated once, at its own absolute position.
    `pos` is the number of positions already cached; the model advances it after a forward.
    A sliding-window layer of window W keeps only its last W - 1 keys and values (all a
    later query can see besides itself): `update_window`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device=None,
        dtype=torch.float32,
    ):
        self.max_len = max_len or cfg.max_seq_len
        self.windows = [p.window for p in layer_positions(cfg)]
        shape = (batch_size, cfg.kv_heads, self.max_len, cfg.head_dim)
        empty = (batch_size, cfg.kv_heads, 0, cfg.head_dim)
        self.k = [
            torch.zeros(empty if w else shape, device=device, dtype=dtype) for w in self.windows
        ]
        self.v = [
            torch.zeros(empty if w else shape, device=device, dtype=dtype) for w in self.windows
        ]
        self.pos = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.pos, self.pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions; asked for position {end - 1}"
            )
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def update_window(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the kept keys then k, the same of values, how many were kept): a sliding layer
        attends over its last W - 1 keys and the new ones, and keeps the last W - 1 of those."""
        kept = self.k[layer].shape[2]
        keys, values = torch.cat((self.k[layer], k), dim=2), torch.cat((self.v[layer], v), dim=2)
        keep = max(window - 1, 0)
        self.k[layer] = keys[:, :, keys.shape[2] - min(keep, keys.shape[2]) :]
        self.v[layer] = values[:, :, values.shape[2] - min(keep, values.shape[2]) :]
        return keys, values, kept


class ALiBi:
    """A layer's ALiBi slopes (H,), fp32 on the device that asks (copied there once). Not a
    buffer: derived from n_heads alone, so a model built on the meta device or cast to bf16
    never holds them on meta or rounded."""

    def __init__(self, n_heads: int):
        self.slopes = alibi_slopes(n_heads)
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self.slopes.to(device)
        return self._on[device]


class PairMask:
    """A layer's pair selection (model.rope_pairs) as the masks apply_rope takes: which dims
    of each query head (H, 1, D) and key head (KV, 1, D) rotate, query heads following their
    KV group; bool, on the device that asks (copied there once). Not a buffer, for ALiBi's
    reasons: a meta build or a dtype cast must not touch it."""

    def __init__(self, position: LayerPosition, n_heads: int):
        keep = position.kept_dims()
        assert keep is not None
        self.k = keep
        self.q = keep.repeat_interleave(n_heads // keep.shape[0], dim=0)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """What the masks take on a device (one byte per bool)."""
        return self.q.numel() + self.k.numel()

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self.q.to(device), self.k.to(device))
        return self._on[device]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, position: LayerPosition | None = None):
        super().__init__()
        position = position or layer_positions(cfg)[0]
        # This layer's attention span: None = every earlier token, W = the last W (sliding).
        self.window = position.window
        self.alibi = ALiBi(cfg.n_heads) if position.alibi else None
        self.pairs = PairMask(position, cfg.n_heads) if position.pairs is not None else None
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        # One fused projection for q, k, v: [q heads | k heads | v heads].
        self.qkv = nn.Linear(
            cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=cfg.attn_bias
        )
        self.proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.attn_bias)
        # QK-Norm over head_dim: one weight of size head_dim for q and one for k, shared by
        # all heads, so it is the same with any number of kv heads (GQA-safe).
        self.q_norm = (
            make_norm(cfg.norm, self.head_dim, cfg.norm_eps, cfg.norm_bias) if cfg.qk_norm else None
        )
        self.k_norm = (
            make_norm(cfg.norm, self.head_dim, cfg.norm_eps, cfg.norm_bias) if cfg.qk_norm else None
        )
        self.dropout = cfg.dropout
        self.softcap = cfg.attn_logit_softcap
        # The kernel, as F.scaled_dot_product_attention's signature; None = the kernel that
        # choose_kernel picks (Transformer.set_attention_fn; the planner puts FlashAttention's
        # memory here).
        self.attention_fn: AttentionFn | None = None

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (B, H, T, D), k and v (B, KV, T, D) of the input x (B, T, d_model): projected,
        QK-Normed and rotated, as the attention uses them."""
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, KV * D, KV * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, KV, D), v.view(B, T, KV, D)
        if self.q_norm is not None:
            # Before the transpose: each head's D values are contiguous and the rows are in
            # memory order, so the norm reads and writes (B, T, H, D) in order (not a
            # transposed view) and its backward's gradients come out contiguous.
            q, k = self.q_norm(q), self.k_norm(k)
        keep_q, keep_k = self.pairs.on(x.device) if self.pairs is not None else (None, None)
        # (B, H, T, D) views of the (B, T, H, D) memory, as SDPA takes them
        return (
            apply_rope(q.transpose(1, 2), cos, sin, keep_q),
            apply_rope(k.transpose(1, 2), cos, sin, keep_k),
            v.transpose(1, 2),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.heads(x, cos, sin)
        cached = 0
        if kv_cache is not None and self.window is not None:
            k, v, cached = kv_cache.update_window(layer, k, v, self.window)
        elif kv_cache is not None:
            cached = kv_cache.pos
            k, v = kv_cache.update(layer, k, v)
        dropout = self.dropout if self.training else 0.0
        kernel = choose_kernel(
            q.device,
            head_dim=self.head_dim,
            documents=documents is not None,
            dropout=dropout,
            soft_cap=self.softcap,
            injected=self.attention_fn is not None,
            window=self.window is not None,
            alibi=self.alibi is not None,
            cached=cached > 0,
        )
        y = attend(
            q,
            k,
            v,
            kernel=kernel,
            documents=documents,
            cached=cached,
            dropout_p=dropout,
            soft_cap=self.softcap,
            fn=self.attention_fn,
            window=self.window,
            slopes=None if self.alibi is None else self.alibi.on(q.device),
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def choose_kernel(
    device: torch.device | str,
    *,
    head_dim: int,
    documents: bool,
    dropout: float,
    soft_cap: float,
    injected: bool,
    window: bool = False,
    alibi: bool = False,
    cached: bool = False,
) -> Kernel:
    """The kernel that runs one attention, from what it must honour: the device, the mask
    kind (plain causal, or packed `documents`; a sliding `window`; `alibi` biases; queries
    after `cached` keys of a KV cache), the dropout of this forward (0 in eval), the
    attention-logit `soft_cap` and whether a kernel was `injected` (set_attention_fn).

    =========  =====================================================  =====================
    kernel     runs when                                              mask it receives
    =========  =====================================================  =====================
    unfused    soft_cap > 0, any device, mask or dropout              dense bool (T x T or
                                                                      B x 1 x T x T)
    injected   a kernel was injected and soft_cap == 0                is_causal=True, or a
                                                                      dense bool mask
    flex       documents, a window or ALiBi, no cached keys, CUDA,    the BlockMask (of the
               dropout == 0, head dim in FLEX_HEAD_DIMS               window too); ALiBi as
               (document_attention_backend)                           a score modifier
    sdpa       everything else: plain causal anywhere, documents,     is_causal=True, or a
               windows or ALiBi on CPU, in decoding (cached keys),    dense bool mask; with
               with dropout or outside flex's head dims               ALiBi a float bias
    =========  =====================================================  =====================

    Windows and ALiBi on CUDA at paper sizes therefore never materialise a T x T mask or
    bias: the BlockMask skips the tiles outside the window, the score modifier adds the bias
    inside the kernel. The dense forms (dense_position_mask) are the CPU path, decoding
    (a few queries) and the dropout / head-dim fallback.

    Why this order: the cap changes the scores themselves, and neither SDPA nor our
    FlexAttention call takes one, so a capped model has one path. An injected kernel stands
    for SDPA (a tracer, an FP8 or a custom kernel): it must see every mask SDPA would, so it
    is never handed a BlockMask (which SDPA's signature cannot take) and never bypassed for
    FlexAttention; with documents it gets the dense mask. FlexAttention skips the masked
    tiles of packed documents but has no dropout. A "dense bool" mask is True = attend.

    Refused, one line (ConfigError): a soft cap with an injected kernel, which could only
    be honoured by not calling the kernel that was injected.
    """
    if soft_cap > 0:
        if injected:
            raise ConfigError(
                f"model.attn_logit_softcap={soft_cap} runs the unfused soft-capped attention, "
                f"and an injected attention kernel (Transformer.set_attention_fn) has "
                f"F.scaled_dot_product_attention's signature, which takes no cap; set "
                f"model.attn_logit_softcap=0 or call set_attention_fn(None)"
            )
        return "unfused"
    if injected:
        return "injected"
    masked = documents or window or alibi
    if (
        masked
        and not cached
        and document_attention_backend(device, head_dim, dropout, soft_cap) == "flex"
    ):
        return "flex"
    return "sdpa"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: Kernel,
    documents: DocumentMask | None = None,
    cached: int = 0,
    dropout_p: float = 0.0,
    soft_cap: float = 0.0,
    fn: AttentionFn | None = None,
    window: int | None = None,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, KV, cached + T, D) with `kernel`
    (choose_kernel's choice; tests force the others), (B, H, T, D) out. `window`: each query
    sees itself and the window - 1 keys before it; `slopes` (H,): ALiBi's -slope_h x (i - j)
    on the scaled logits (i - j: the distance in tokens, which with documents is the
    distance within the document).

    The mask: `documents` (packed documents: causal within each document), else causal with
    the queries at the last T of the cached + T keys (`cached` keys from a KV cache). Every
    kernel gets that mask in the form it takes, built from the DocumentMask's ids when the
    mask was built for another kernel, so no kernel runs unmasked. A combination that cannot
    be honoured raises a one-line ValueError instead: FlexAttention without documents, after
    cached keys or with dropout; a soft cap on a kernel other than unfused (or none on it);
    `fn` without kernel="injected" (or none with it); documents with cached keys.
    """
    _check_attend(kernel, documents, cached, dropout_p, soft_cap, fn, window, slopes)
    T = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if kernel == "flex":
        compile = documents.compile if documents is not None else q.is_cuda
        return flex_document_attention(q, k, v, documents, compile, window, slopes)
    # SDPA's is_causal aligns the mask top-left; with cached keys the queries sit at the
    # bottom-right, so past the first chunk we pass the mask ourselves (one query after
    # cached keys attends to all of them: no mask).
    mask, causal = None, True
    if documents is not None:
        mask, causal = documents.as_dense(), False
    elif cached > 0:
        causal = False
        if T > 1:
            mask = torch.ones(T, cached + T, dtype=torch.bool, device=q.device).tril(cached)
    if window is not None or slopes is not None:
        mask = dense_position_mask(T, cached, window, slopes, mask, q.dtype, q.device)
        causal = False
    if kernel == "unfused":
        if mask is None and causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return softcapped_attention(q, k, v, mask, soft_cap, dropout_p)
    sdpa = fn if kernel == "injected" else F.scaled_dot_product_attention
    return sdpa(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p, enable_gqa=gqa)


def _check_attend(
    kernel: Kernel,
    documents: DocumentMask | None,
    cached: int,
    dropout_p: float,
    soft_cap: float,
    fn: AttentionFn | None,
    window: int | None = None,
    slopes: torch.Tensor | None = None,
) -> None:
    """One line for each way `attend`'s arguments would drop a mask, a cap or a kernel."""
    masked = documents is not None or window is not None or slopes is not None
    problem = None
    if kernel not in ("sdpa", "flex", "injected", "unfused"):
        problem = f"kernel={kernel!r} is none of sdpa, flex, injected, unfused"
    elif (fn is not None) != (kernel == "injected"):
        problem = (
            f"kernel={kernel!r} with fn={'None' if fn is None else 'a kernel'}: the injected "
            f"kernel runs exactly when kernel='injected' and fn is given (choose_kernel)"
        )
    elif (soft_cap > 0) != (kernel == "unfused"):
        problem = (
            f"kernel={kernel!r} with soft_cap={soft_cap}: only kernel='unfused' applies a soft "
            f"cap, and it needs one > 0 (choose_kernel)"
        )
    elif documents is not None and cached > 0:
        problem = (
            f"documents with cached={cached} keys: incremental decoding runs one document; "
            f"pass documents=None"
        )
    elif kernel == "flex" and (not masked or dropout_p > 0 or cached > 0):
        problem = (
            f"kernel='flex' with documents={'None' if documents is None else 'a mask'}, "
            f"window={window}, alibi={slopes is not None}, cached={cached} and "
            f"dropout_p={dropout_p}: FlexAttention runs document masks, windows or ALiBi "
            f"without cached keys or dropout only; use kernel='sdpa' (choose_kernel)"
        )
    if problem is not None:
        raise ValueError(f"attend: {problem}")


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cap: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T / (sqrt(D) cap)) + mask) v, the softmax in fp32 (Gemma 2's
    attention-logit soft cap). No SDPA kernel takes a cap, so this is the unfused path: it
    holds the (T x T) scores of every head, which long sequences pay for in memory."""
    H, KV = q.shape[1], k.shape[1]
    if KV != H:  # GQA: each kv head serves H / KV query heads
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / cap) * cap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:  # a float bias (ALiBi), -inf where masked
        scores = scores + mask.float()
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout > 0:
        p = F.dropout(p, dropout)
    return p @ v
