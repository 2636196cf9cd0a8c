"""Attention that stops at document boundaries (data.document_mask): each token attends to
the earlier tokens of its own document only, a block-diagonal causal mask.

Two kernels, one mask definition (causal and the same document id); which one runs is
decided with the other attention kernels in one place, pretrain.model.attention.choose_kernel:

- **FlexAttention** (`torch.nn.attention.flex_attention`) on CUDA: the mask is a `BlockMask`
  of 128 x 128 tiles built from the document ids (no T x T tensor), fully masked tiles are
  skipped (the executed FLOPs are the attended tiles'), and the kernel is compiled by
  torch.compile into one Triton kernel, forward and backward, as PyTorch documents. It takes
  every head dim of our configs (64 llama1b, 128 llama8b, 256 pythia1b), bf16 and fp32, and
  GQA (`enable_gqa`). It has no dropout, so a model with attention dropout > 0 in training
  takes the mask path below (our paper configs have none; the character-level GPT, the one
  config with dropout, has no end-of-document token to mask at).
  FlashAttention's varlen kernel would do the same from cumulative lengths, but it is not a
  dependency (it builds against one CUDA toolkit); FlexAttention ships with torch.
- **SDPA with a boolean mask** (B, 1, T, T) everywhere else: CPU (tests, the quickstart),
  and the dropout case. On CUDA this mask path runs the memory-efficient or cuDNN kernel at
  2-9x the cost of the unmasked causal kernel, measured elsewhere (unsloth PR #11102, head dim
  64 to 256, T 2048 to 8192), which is why it is not the GPU path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Backend = Literal["flex", "sdpa_mask"]


# FlexAttention's GPU kernel: head dims from 16 (below, the Triton template raises) to 256
# (torch's tuned tile settings stop there; larger ones run out of shared memory).
FLEX_HEAD_DIMS = (16, 256)


def document_attention_backend(
    device: torch.device | str, head_dim: int = 64, dropout: float = 0.0, softcap: float = 0.0
) -> Backend:
    """Whether FlexAttention can run a document mask here: "flex" on CUDA for head dims in
    FLEX_HEAD_DIMS (see the module docstring); "sdpa_mask" on CPU, with attention dropout in
    training (FlexAttention has none), with an attention-logit soft cap (its unfused path
    takes the boolean mask) and for head dims outside FlexAttention's range. The kernel that
    runs also depends on an injected one: attention.choose_kernel decides, from this."""
    lo, hi = FLEX_HEAD_DIMS
    if torch.device(device).type != "cuda" or dropout > 0 or softcap > 0:
        return "sdpa_mask"
    return "flex" if lo <= head_dim <= hi else "sdpa_mask"


@dataclass
class DocumentMask:
    """The document mask of one forward, built once and shared by every layer.

    `backend` is the form built up front, for the kernel the model chose; a kernel that
    takes the other form (a layer with its own injected kernel, a test) gets it from
    `as_dense` / `as_block_mask`, built from the ids on first use and kept. Neither form is
    ever read as None: None means "no mask" to SDPA and to FlexAttention alike.
    """

    document_ids: torch.Tensor  # (B, T) int64
    backend: Backend
    dense: torch.Tensor | None = None  # (B, 1, T, T) bool, True = attend: sdpa_mask
    block_mask: Any = None  # a FlexAttention BlockMask: flex
    compile: bool = True  # the compiled FlexAttention functions (see build)
    # BlockMasks of sliding-window layers, by window (built on first use, kept for the forward)
    windowed: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls, document_ids: torch.Tensor, backend: Backend, compile: bool = True
    ) -> DocumentMask:
        """`compile=False` (tests on CPU): the eager FlexAttention functions, which evaluate
        the same mask rule but hold the whole mask; the compiled ones never do."""
        mask = cls(document_ids, backend, compile=compile)
        if backend == "flex":
            mask.as_block_mask()
        else:
            mask.as_dense()
        return mask

    def as_dense(self) -> torch.Tensor:
        """(B, 1, T, T) bool, True = attend: the mask SDPA, an injected kernel and the
        soft-capped path take."""
        if self.dense is None:
            same = self.document_ids[:, :, None] == self.document_ids[:, None, :]
            self.dense = same.tril()[:, None]
        return self.dense

    def as_block_mask(self, window: int | None = None) -> Any:
        """The FlexAttention BlockMask of the same rule (and a sliding `window`)."""
        if window is not None:
            if window not in self.windowed:
                self.windowed[window] = _block_mask(self.document_ids, self.compile, window)
            return self.windowed[window]
        if self.block_mask is None:
            self.block_mask = _block_mask(self.document_ids, self.compile)
        return self.block_mask


_compiled: dict[str, Any] = {}


def _block_mask(document_ids: torch.Tensor, compile: bool = True, window: int | None = None) -> Any:
    """The BlockMask of causal & same document (& within `window`: kv > q - window), by the
    compiled `create_block_mask`, which evaluates the rule tile by tile (eager, it would hold
    the whole (B, T, T) mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_document(b, h, q, kv):
        allowed = (q >= kv) & (document_ids[b, q] == document_ids[b, kv])
        return allowed if window is None else allowed & (kv > q - window)

    if compile and "mask" not in _compiled:
        _compiled["mask"] = torch.compile(create_block_mask)
    build = _compiled["mask"] if compile else create_block_mask
    B, T = document_ids.shape
    return build(causal_same_document, B, None, T, T, device=document_ids.device)


_plain_masks: dict[tuple, Any] = {}


def causal_block_mask(
    length: int, window: int | None, device: torch.device, compile: bool = True
) -> Any:
    """The BlockMask of plain causal attention over `length` tokens (& within `window`),
    the same for every row and head: built once per (length, window, device) and kept."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (length, window, str(device), compile)
    if key not in _plain_masks:

        def causal(b, h, q, kv):
            return q >= kv if window is None else (q >= kv) & (kv > q - window)

        if compile and "mask" not in _compiled:
            _compiled["mask"] = torch.compile(create_block_mask)
        build = _compiled["mask"] if compile else create_block_mask
        _plain_masks[key] = build(causal, None, None, length, length, device=device)
    return _plain_masks[key]


def dense_position_mask(
    queries: int,
    cached: int,
    window: int | None,
    slopes: torch.Tensor | None,
    allowed: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The mask SDPA takes for a sliding window and/or ALiBi, queries at the last `queries`
    of cached + queries keys: bool (.., T, K) True = attend, or with `slopes` (H,) a float
    bias (.., H, T, K) of -slope x (i - j) where allowed and -inf elsewhere. `allowed`: a
    document mask (B, 1, T, K) to combine, or None for plain causal. Holds T x K (x H): the
    CPU and fallback path, never FlexAttention's."""
    i = torch.arange(queries, device=device)[:, None] + cached  # query positions among keys
    j = torch.arange(cached + queries, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (j > i - window)
    if allowed is not None:
        mask = mask & allowed
    if slopes is None:
        return mask
    bias = -slopes.to(device=device, dtype=torch.float32)[:, None, None] * (i - j).float()
    return bias.masked_fill(~mask, float("-inf")).to(dtype)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask | None,
    compile: bool = True,
    window: int | None = None,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention with the block mask of the documents (or plain causal when `mask` is
    None) and a sliding `window`, ALiBi's -slope_h x (q - kv) as a score modifier when
    `slopes` (H,) fp32 are given (added to the scaled scores, in fp32, as SDPA adds a float
    mask); compiled once per process (eager FlexAttention is a slow reference that builds
    the scores: `compile=False` for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compile and "attention" not in _compiled:
        _compiled["attention"] = torch.compile(flex_attention, dynamic=False)
    flex = _compiled["attention"] if compile else flex_attention
    if mask is not None:
        block_mask = mask.as_block_mask(window)
    else:
        block_mask = causal_block_mask(q.shape[2], window, q.device, compile)
    score_mod = None
    if slopes is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

    return flex(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        enable_gqa=k.shape[1] != q.shape[1],
    )
