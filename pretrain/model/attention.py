"""Causal self-attention: MHA or GQA, optional QK-Norm, partial RoPE, SDPA, KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.model.document_attention import DocumentMask, flex_document_attention
from pretrain.model.norm import make_norm
from pretrain.model.rope import apply_rope


class KVCache:
    """Keys and values of every layer for incremental decoding.

    Keys are stored after RoPE, so each is rotated once, at its own absolute position.
    `pos` is the number of positions already cached; the model advances it after a forward.
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
        shape = (batch_size, cfg.kv_heads, self.max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
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
        # The kernel, as F.scaled_dot_product_attention's signature; None = that function
        # (Transformer.set_attention_fn; the planner puts FlashAttention's memory here).
        self.attention_fn: Callable[..., torch.Tensor] | None = None

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
        # (B, H, T, D) views of the (B, T, H, D) memory, as SDPA takes them
        return (
            apply_rope(q.transpose(1, 2), cos, sin),
            apply_rope(k.transpose(1, 2), cos, sin),
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
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.heads(x, cos, sin)
        if documents is not None:  # packed documents: a block-diagonal causal mask
            y = self._document_attention(q, k, v, documents)
            return self.proj(y.transpose(1, 2).reshape(B, T, H * D))

        start = 0
        if kv_cache is not None:
            start = kv_cache.pos
            k, v = kv_cache.update(layer, k, v)

        # SDPA's is_causal aligns the mask top-left; with cached keys the queries sit at the
        # bottom-right, so past the first chunk we pass the mask ourselves.
        mask, causal = None, True
        if start > 0:
            causal = False
            if T > 1:
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
        dropout = self.dropout if self.training else 0.0
        if self.softcap > 0:
            if mask is None and causal:
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            y = softcapped_attention(q, k, v, mask, self.softcap, dropout)
        else:
            sdpa = self.attention_fn or F.scaled_dot_product_attention
            y = sdpa(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout, enable_gqa=KV != H
            )
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.proj(y)

    def _document_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask
    ) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.softcap > 0:
            return softcapped_attention(q, k, v, documents.dense, self.softcap, dropout)
        if documents.backend == "flex" and self.attention_fn is None:
            return flex_document_attention(q, k, v, documents)
        sdpa = self.attention_fn or F.scaled_dot_product_attention
        return sdpa(
            q,
            k,
            v,
            attn_mask=documents.dense,
            is_causal=False,
            dropout_p=dropout,
            enable_gqa=k.shape[1] != q.shape[1],
        )


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
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout > 0:
        p = F.dropout(p, dropout)
    return p @ v
