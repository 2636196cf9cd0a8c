"""Packed documents in the model: with `document_ids` (and `position_ids`), a packed batch
computes what each document computes on its own, forward and backward, for every block and
attention variant; the kernel choice for GPUs against FlexAttention's documented limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.config import ModelConfig
from pretrain.data.documents import document_ids, document_positions, model_inputs_of
from pretrain.model.document_attention import (
    DocumentMask,
    document_attention_backend,
    flex_document_attention,
)
from pretrain.model.transformer import Transformer

EOD = 96
VARIANTS = {
    "sequential": {},
    "parallel": {"block": "parallel", "norm": "layernorm", "mlp": "gelu"},
    "gqa": {"n_kv_heads": 2},
    "qk_norm": {"qk_norm": True},
    "partial_rope": {"rope_fraction": 0.25},
    "nope": {"rope_fraction": 0.0},
    "learned_positions": {"learned_pos_emb": True, "rope_fraction": 0.0},
    "softcap": {"attn_logit_softcap": 30.0},
    "recompute": {},  # every block recomputed in the backward: the mask goes through checkpoint
}
# Rows of 32 tokens: documents of 5, 11 and 16 tokens (each ending with its EOD, the last cut
# by the row's end), in other orders in the other rows.
LAYOUTS = [[5, 11, 16], [16, 5, 11], [11, 16, 5]]


def model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=97,
        pad_vocab_to_multiple=8,
        n_layers=2,
        d_model=64,
        n_heads=4,
        d_ff=96,
        max_seq_len=64,
    )
    return Transformer(ModelConfig(**{**cfg, **kw})).double()


def packed() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, EOD, (len(LAYOUTS), 32), generator=g)
    for r, lengths in enumerate(LAYOUTS):
        ends = torch.tensor(lengths).cumsum(0) - 1
        rows[r, ends[:-1]] = EOD  # the last document runs past the row: no EOD
    return rows


def pieces(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in the packed rows."""
    out = []
    for r, lengths in enumerate(LAYOUTS):
        start = 0
        for n in lengths:
            out.append((r, start, start + n))
            start += n
    return out


@pytest.mark.parametrize("reset", [True, False], ids=["position_reset", "packed_positions"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_batch_equals_each_document_on_its_own(variant, reset):
    m = model(**VARIANTS[variant])
    m.gradient_checkpointing = variant == "recompute"
    # In fp64 the two computations agree to rounding; the soft cap's softmax runs in fp32
    # whatever the model's dtype, so there the bound is the fp32 one.
    tol = 1e-6 if variant == "softcap" else 1e-10
    rows = packed()
    ids = document_ids(rows, EOD)
    positions = document_positions(ids) if reset else torch.arange(32).expand(len(rows), 32)
    targets = torch.randint(0, EOD, rows.shape, generator=torch.Generator().manual_seed(2))
    logits = m(rows, document_ids=ids, position_ids=positions)
    # The packed loss, summed over tokens, and its gradients.
    m.zero_grad()
    torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="sum"
    ).backward()
    packed_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    # Each document alone, at the positions it had in the packed row.
    m.zero_grad()
    for r, a, b in pieces(rows):
        alone = m(rows[r : r + 1, a:b], position_ids=positions[r : r + 1, a:b])
        torch.testing.assert_close(alone[0], logits[r, a:b], rtol=0, atol=tol)
        torch.nn.functional.cross_entropy(alone[0], targets[r, a:b], reduction="sum").backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, packed_grads[n], rtol=0, atol=tol, msg=n)


def test_changing_one_document_leaves_the_next_bit_identical():
    m = model(qk_norm=True, rope_fraction=0.25).float()
    rows = packed()
    ids = document_ids(rows, EOD)
    pos = document_positions(ids)
    before = m(rows, document_ids=ids, position_ids=pos)
    changed = rows.clone()
    changed[0, :4] = (changed[0, :4] + 7) % EOD  # document 1 of row 0 (its EOD kept)
    after = m(changed, document_ids=ids, position_ids=pos)
    assert torch.equal(before[0, 5:], after[0, 5:])
    assert not torch.equal(before[0, :5], after[0, :5])


def test_one_document_and_arange_positions_are_the_plain_model():
    m = model(rope_fraction=0.5, qk_norm=True).float()
    rows = packed()
    plain = m(rows)
    one = torch.zeros_like(rows)
    torch.testing.assert_close(m(rows, document_ids=one), plain, rtol=0, atol=1e-6)
    arange = torch.arange(32).expand_as(rows)
    assert torch.equal(m(rows, position_ids=arange), plain)


def test_position_ids_give_each_token_its_own_rope_rows():
    """Without a document mask RoPE sees the positions themselves: per-token cos/sin are the
    cache's rows at each position (bit for bit), restarted positions change the logits, and
    a shift of all positions does not (RoPE is relative)."""
    m = model(rope_fraction=0.5).float()
    rows = packed()
    reset = document_positions(document_ids(rows, EOD))
    cos, sin = m.rope.at(reset)
    assert cos.shape == (3, 1, 32, m.cfg.rope_dims)
    assert torch.equal(cos[1, 0, 20], m.rope.cos[reset[1, 20]])
    assert torch.equal(sin[2, 0, 5], m.rope.sin[reset[2, 5]])
    plain = m(rows)
    assert (m(rows, position_ids=reset) - plain).abs().max() > 1e-3
    shifted = torch.arange(32).expand_as(rows) + 7
    torch.testing.assert_close(m(rows, position_ids=shifted), plain, rtol=0, atol=1e-5)


class _HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value into Python (int(t), t.tolist(), t.item()): on a GPU
    each is a synchronisation."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_pipelines_positions_are_never_read_back_by_the_forward():
    """Training's document inputs (model_inputs_of: positions made on the host, and their
    largest read there) let the forward and backward run without one read of a tensor's
    value, as on a GPU without a synchronisation per micro batch; the loss is the one the
    model computes when it reads the positions itself."""
    m = model(rope_fraction=0.5).float()
    rows = packed()
    batch = {"position_ids": document_positions(document_ids(rows, EOD))}
    inputs = model_inputs_of(batch, "cpu")
    assert inputs["max_position"] == int(batch["position_ids"].max())
    with _HostReads() as reads:
        loss = m(rows, targets=rows, **inputs).loss
        loss.backward()
    assert reads.count == 0
    with _HostReads() as reads:
        again = m(rows, targets=rows, position_ids=batch["position_ids"]).loss
    assert reads.count > 0  # the positions' bounds: what the pipeline's hint saves
    assert torch.equal(again, loss.detach())


def test_bad_document_inputs_are_one_clear_error():
    m = model().float()
    rows = packed()
    with pytest.raises(ValueError, match=r"document_ids has shape \(3, 31\)"):
        m(rows, document_ids=document_ids(rows, EOD)[:, 1:])
    from pretrain.model.attention import KVCache

    cache = KVCache(m.cfg, 3)
    with pytest.raises(ValueError, match="position_ids with a kv_cache"):
        m(rows, kv_cache=cache, position_ids=torch.zeros_like(rows))
    with pytest.raises(ValueError, match="negative position"):
        m(rows, position_ids=torch.full_like(rows, -1))


def test_gpu_kernel_choice():
    """FlexAttention on CUDA for every head dim of our paper configs (in its supported range);
    the boolean-mask SDPA path on CPU, with dropout (FlexAttention has none), with a soft cap
    (the unfused path) and outside FlexAttention's head dims."""
    from pretrain.config import load_config

    repo = Path(__file__).resolve().parents[1]
    for name in ("llama1b_rope10", "llama8b_rope10", "pythia1b_rope10"):
        m = load_config(repo / "configs" / "paper" / f"{name}.yaml").model
        assert m.head_dim in (64, 128, 256)
        assert document_attention_backend("cuda", m.head_dim, m.dropout) == "flex", name
    assert document_attention_backend("cuda:1", 64) == "flex"
    assert document_attention_backend("cpu", 64) == "sdpa_mask"
    assert document_attention_backend("cuda", 64, dropout=0.1) == "sdpa_mask"
    assert document_attention_backend("cuda", 64, softcap=30.0) == "sdpa_mask"
    assert document_attention_backend("cuda", 8) == "sdpa_mask"
    assert document_attention_backend("cuda", 512) == "sdpa_mask"


def test_flex_attention_computes_the_mask_path_on_cpu():
    """The GPU kernel's mask rule and FlexAttention call, run on CPU (eagerly: the compiled
    CPU kernel takes ~20 s to build and is not the GPU's Triton kernel anyway): the same
    numbers as the boolean-mask path, with GQA."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 32, 16, generator=g)
    k, v = torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 2, 32, 16, generator=g)
    ids = document_ids(packed()[:2], EOD)
    with torch.no_grad():  # eager FlexAttention on CPU has no backward
        flex = flex_document_attention(
            q, k, v, DocumentMask.build(ids, "flex", compile=False), compile=False
        )
    dense = DocumentMask.build(ids, "sdpa_mask").dense
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, enable_gqa=True
    )
    torch.testing.assert_close(flex, ref, rtol=0, atol=1e-5)
    # Tiles of 128: two documents of 128 tokens touch the 2 diagonal tiles, never the tile
    # below them that the causal mask alone would run (nor the one above).
    two = torch.tensor([[0] * 128 + [1] * 128])
    bm = DocumentMask.build(two, "flex", compile=False).block_mask
    assert int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) == 2
    causal = DocumentMask.build(torch.zeros_like(two), "flex", compile=False).block_mask
    assert int(causal.kv_num_blocks.sum() + causal.full_kv_num_blocks.sum()) == 3
