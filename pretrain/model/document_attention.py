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

from dataclasses import dataclass
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

    def as_block_mask(self) -> Any:
        """The FlexAttention BlockMask of the same rule."""
        if self.block_mask is None:
            self.block_mask = _block_mask(self.document_ids, self.compile)
        return self.block_mask


_compiled: dict[str, Any] = {}


def _block_mask(document_ids: torch.Tensor, compile: bool = True) -> Any:
    """The BlockMask of causal & same document, by the compiled `create_block_mask`, which
    evaluates the rule tile by tile (eager, it would hold the whole (B, T, T) mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_document(b, h, q, kv):
        return (q >= kv) & (document_ids[b, q] == document_ids[b, kv])

    if compile and "mask" not in _compiled:
        _compiled["mask"] = torch.compile(create_block_mask)
    build = _compiled["mask"] if compile else create_block_mask
    B, T = document_ids.shape
    return build(causal_same_document, B, None, T, T, device=document_ids.device)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    compile: bool = True,
) -> torch.Tensor:
    """FlexAttention with the document block mask; compiled once per process (eager
    FlexAttention is a slow reference that builds the scores: `compile=False` for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compile and "attention" not in _compiled:
        _compiled["attention"] = torch.compile(flex_attention, dynamic=False)
    flex = _compiled["attention"] if compile else flex_attention
    return flex(q, k, v, block_mask=mask.as_block_mask(), enable_gqa=k.shape[1] != q.shape[1])


__all__ = [
    "FLEX_HEAD_DIMS",
    "Backend",
    "DocumentMask",
    "document_attention_backend",
    "flex_document_attention",
]
