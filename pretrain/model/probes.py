"""Read-only probes of a model's internals, computed on demand: the model keeps no state.

`max_attention_logits(model, input_ids)`: per layer, the largest |q.k| / sqrt(head_dim)
over the causal positions of one forward (the attention-logit growth that QK-Norm is meant
to stop). Forward pre-hooks on each attention module take its input, project q and k with
the module's own weights (`Attention.heads`: QK-Norm and RoPE as in the forward), and
reduce the scores a block of queries x a block of keys at a time, so memory is
O(block^2 x heads), never the T x T score matrix (at seq 8192 that was 8 GiB per head
group in fp32, ~25 GiB with its temporaries). The hooks are removed before returning.
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK = 512  # queries (and keys) per block: 512 x 512 x heads fp32 scores at a time


@torch.no_grad()
def causal_max_abs_logit(
    q: torch.Tensor, k: torch.Tensor, start: int = 0, block: int = BLOCK
) -> torch.Tensor:
    """max |q_i . k_j| / sqrt(D) over j <= start + i, as an fp32 0-d tensor.

    q: (B, H, T, D) queries at positions start .. start+T-1; k: (B, KV, S, D) keys at
    positions 0 .. S-1, KV dividing H (GQA: query head h reads key head h // (H / KV), as
    `repeat_interleave` does). Scores are fp32 products of the fp32 casts of q and k, the
    same numbers as the whole score matrix, taken `block` x `block` at a time.
    """
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    g = H // KV
    scale = 1.0 / math.sqrt(D)
    best = torch.zeros((), dtype=torch.float32, device=q.device)
    qg = q.view(B, KV, g, T, D)
    for qs in range(0, T, block):
        qe = min(qs + block, T)
        last_key = start + qe  # keys < last_key are visible to some query of the block
        qb = qg[:, :, :, qs:qe].float().reshape(B, KV, g * (qe - qs), D)
        for ks in range(0, min(S, last_key), block):
            ke = min(ks + block, S, last_key)
            s = (qb @ k[:, :, ks:ke].float().transpose(-1, -2)).abs_()  # (B, KV, g*bq, bk)
            if ke - 1 > start + qs:  # part of the block is above the diagonal
                qpos = torch.arange(qs, qe, device=q.device) + start
                kpos = torch.arange(ks, ke, device=q.device)
                keep = (kpos[None, :] <= qpos[:, None]).repeat(g, 1)  # (g*bq, bk)
                s = s.masked_fill_(~keep, 0)
            best = torch.maximum(best, s.amax())
    return best * scale


@torch.no_grad()
def max_attention_logits(model: Any, input_ids: torch.Tensor, block: int = BLOCK) -> list[float]:
    """Per layer, max |q.k| / sqrt(head_dim) of one forward over `input_ids` (B, T).

    `model`: a Transformer or a DeepSpeed engine wrapping one. Runs the blocks in eval mode
    without gradients (no output layer) and restores the mode; the model is unchanged.
    """
    return attention_logit_maxima(model, input_ids, block).tolist()


@torch.no_grad()
def attention_logit_maxima(model: Any, input_ids: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`max_attention_logits` as one fp32 tensor (n_layers,) on the model's device."""
    module = getattr(model, "module", model)
    found: list[torch.Tensor] = []

    def hook(attn, args, kwargs):
        x, cos, sin = args[:3]  # Block calls attn(x, cos, sin, kv_cache, layer)
        q, k, _ = attn.heads(x, cos, sin)
        found.append(causal_max_abs_logit(q, k, 0, block))

    handles = [blk.attn.register_forward_pre_hook(hook, with_kwargs=True) for blk in module.blocks]
    was_training = module.training
    module.eval()
    try:
        module.hidden_states(input_ids)
    finally:
        for h in handles:
            h.remove()
        module.train(was_training)
    return torch.stack(found)
