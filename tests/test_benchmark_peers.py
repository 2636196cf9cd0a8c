"""The peers `tools/benchmark.py peers` races hold our weights: same losses and gradients as
our model (the benchmark also checks the losses before timing)."""

from __future__ import annotations

import pytest
import torch
from conftest import missing

from pretrain.benchmarks.peer_models import (
    litgpt_available,
    litgpt_gpt,
    llama_config,
    ours,
    transformers_llama,
)
from pretrain.model import Transformer

PEERS = [transformers_llama, litgpt_gpt]


@pytest.mark.parametrize("make_peer", PEERS)
def test_peer_has_our_loss_and_gradients(make_peer):
    if make_peer is litgpt_gpt and not litgpt_available():
        missing("litgpt not installed (make venv installs requirements/bench.txt)")
    torch.manual_seed(0)
    cfg = llama_config(d_model=64, layers=2, heads=4, kv_heads=2, d_ff=96, vocab=128, seq_len=32)
    model = Transformer(cfg).train()
    with torch.no_grad():  # norms away from one, so a swapped norm weight shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mine, peer = ours("ours", model), make_peer(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 2, 32), generator=g)
    want, got = mine.loss(x, y), peer.loss(x, y)
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    want.backward()
    got.backward()
    # The query rows of layer 1's q/k/v projection (transformers keeps q_proj apart; litgpt
    # fuses q, k, v as we do): the same gradients, so the same weights sat in the same places.
    ours_q = model.blocks[1].attn.qkv.weight.grad[: cfg.n_heads * cfg.head_dim]
    names = ("h.1.attn.qkv.weight", "layers.1.self_attn.q_proj.weight")
    peer_q = next(p.grad for n, p in peer.module.named_parameters() if n.endswith(names))
    assert torch.allclose(ours_q, peer_q[: ours_q.shape[0]], rtol=1e-4, atol=1e-6)
