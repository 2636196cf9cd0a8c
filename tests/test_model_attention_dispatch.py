"""The attention kernel is chosen in one place (attention.choose_kernel) and run through one
entry point (attention.attend): every combination of mask and kernel either computes the
dense-mask reference or is refused in one line, never attention without its mask; an
injected kernel (set_attention_fn) gets the documents' dense mask even where FlexAttention
would have run."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ConfigError, ModelConfig
from pretrain.model import attention
from pretrain.model.attention import attend, choose_kernel
from pretrain.model.document_attention import DocumentMask, document_attention_backend
from pretrain.model.transformer import Transformer

B, H, KV, T, D = 2, 4, 2, 32, 16  # GQA: each kv head serves two query heads
CACHED = 5  # keys already in a KV cache before the T queries
CAP = 2.0  # small, so the cap changes the scores visibly
# Documents of 5, 11 and 16 tokens in row 0, 16 and 16 in row 1.
IDS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16, [0] * 16 + [1] * 16])

MASKS = ["causal", "cached", "documents_dense", "documents_block"]
KERNELS = ["sdpa", "flex", "injected", "unfused"]


def tensors(cached: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, KV, cached + T, D, generator=g)
    v = torch.randn(B, KV, cached + T, D, generator=g)
    return q, k, v


def reference_mask(mask: str) -> torch.Tensor:
    """(B, 1, T, keys) bool, True = attend, from the rule itself (not DocumentMask): query i
    sits at key position cached + i and sees the keys at or before it, of its document."""
    cached = CACHED if mask == "cached" else 0
    query = torch.arange(T)[:, None] + cached
    key = torch.arange(cached + T)[None, :]
    allowed = (key <= query).expand(B, 1, T, cached + T)
    if mask.startswith("documents"):
        allowed = allowed & (IDS[:, None, :, None] == IDS[:, None, None, :])
    return allowed


def reference(q, k, v, allowed: torch.Tensor | None, cap: float) -> torch.Tensor:
    """softmax(cap-ed q k^T / sqrt(D), masked) v in fp64; allowed=None: no mask at all."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = q @ k.transpose(-2, -1) / D**0.5
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).float()


class Recording:
    """An injected kernel: SDPA behind it, and what it was handed."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, **kw):
        self.calls.append(kw)
        return F.scaled_dot_product_attention(q, k, v, **kw)


def refused(mask: str, kernel: str, cap: float) -> bool:
    """The combinations attend cannot honour: a cap anywhere but the unfused kernel (or that
    kernel without one), and FlexAttention without documents."""
    return (cap > 0) != (kernel == "unfused") or (
        kernel == "flex" and not mask.startswith("documents")
    )


@torch.no_grad()  # eager FlexAttention on CPU has no backward
@pytest.mark.parametrize("cap", [0.0, CAP], ids=["no_cap", "soft_cap"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mask", MASKS)
def test_every_kernel_and_mask_is_the_dense_reference_or_refused(mask, kernel, cap):
    """{causal, causal after cached keys, documents built for SDPA, documents built for
    FlexAttention} x {sdpa, flex, injected, unfused} x {no cap, soft cap}: attend equals the
    dense-mask reference (to fp32 rounding) or raises one line; the refused set is exactly
    the one attend documents, and the masked reference is far from the unmasked result, so a
    kernel that dropped its mask could not pass."""
    cached = CACHED if mask == "cached" else 0
    q, k, v = tensors(cached)
    documents = None
    if mask.startswith("documents"):
        backend = "flex" if mask == "documents_block" else "sdpa_mask"
        documents = DocumentMask.build(IDS, backend, compile=False)
    fn = Recording() if kernel == "injected" else None
    run = lambda: attend(  # noqa: E731
        q,
        k,
        v,
        kernel=kernel,
        documents=documents,
        cached=cached,
        soft_cap=cap,
        fn=fn,
    )
    if refused(mask, kernel, cap):
        with pytest.raises(ValueError, match="^attend: ") as err:
            run()
        assert "\n" not in str(err.value)
        return
    want = reference(q, k, v, reference_mask(mask), cap)
    unmasked = reference(q, k, v, None, cap)
    assert (want - unmasked).abs().max() > 0.1
    torch.testing.assert_close(run(), want, rtol=0, atol=1e-5)
    if fn is not None:  # called, once, with a mask: never bypassed, never handed None
        (call,) = fn.calls
        assert call["is_causal"] or call["attn_mask"].dtype == torch.bool


def test_what_attend_refuses_besides_the_matrix():
    q, k, v = tensors()
    documents = DocumentMask.build(IDS, "sdpa_mask")
    cases = [
        (dict(kernel="flex", documents=documents, dropout_p=0.1), "FlexAttention runs document"),
        (dict(kernel="sdpa", fn=Recording()), "the injected kernel runs exactly when"),
        (dict(kernel="injected"), "the injected kernel runs exactly when"),
        (dict(kernel="sdpa", documents=documents, cached=3), "incremental decoding"),
        (dict(kernel="math"), "none of sdpa, flex, injected, unfused"),
    ]
    for kw, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            attend(q, k, v, **kw)
        assert "\n" not in str(err.value), kw


def test_choose_kernel_table():
    """Every (device, mask kind, dropout, soft cap, injected, head dim): a cap runs unfused
    and refuses an injected kernel; an injected kernel is never bypassed; FlexAttention only
    for documents, without an injected kernel, where document_attention_backend (which the
    gpu check predicts from) says it can run."""
    for device, documents, dropout, cap, injected, head_dim in itertools.product(
        ["cpu", "cuda"], [False, True], [0.0, 0.1], [0.0, 30.0], [False, True], [64, 8]
    ):
        facts = dict(
            head_dim=head_dim, documents=documents, dropout=dropout, soft_cap=cap, injected=injected
        )
        if cap > 0 and injected:
            with pytest.raises(ConfigError) as err:
                choose_kernel(device, **facts)
            message = str(err.value)
            assert "\n" not in message
            assert (
                "model.attn_logit_softcap=30.0" in message and "set_attention_fn(None)" in message
            )
            continue
        flex = documents and document_attention_backend(device, head_dim, dropout, cap) == "flex"
        want = "unfused" if cap > 0 else "injected" if injected else "flex" if flex else "sdpa"
        assert choose_kernel(device, **facts) == want, facts
    flex = dict(head_dim=64, documents=True, dropout=0.0, soft_cap=0.0, injected=False)
    assert choose_kernel("cuda:0", **flex) == "flex"  # a device index is still CUDA


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, pad_vocab_to_multiple=8, n_layers=2, d_model=64, n_heads=4, d_ff=96)
    return ModelConfig(**{**base, "max_seq_len": 48, **kw})


def test_injected_kernel_gets_the_document_mask_where_flex_would_run(monkeypatch):
    """The dormant bug: on a device where documents run FlexAttention, an injected kernel was
    handed attn_mask=None, is_causal=False (the DocumentMask held only a BlockMask), which is
    attention across documents and into the future. Here FlexAttention is made available on
    CPU: the injected kernel gets the (B, 1, T, T) dense mask in every layer, and the logits
    are the plain model's, bit for bit."""
    monkeypatch.setattr(attention, "document_attention_backend", lambda *a, **k: "flex")
    torch.manual_seed(0)
    model = Transformer(tiny(n_kv_heads=2)).eval()
    x = torch.randint(0, 96, (B, T))
    with torch.no_grad():
        monkeypatch.setattr(attention, "document_attention_backend", lambda *a, **k: "sdpa_mask")
        want = model(x, document_ids=IDS)
        monkeypatch.setattr(attention, "document_attention_backend", lambda *a, **k: "flex")
        fn = Recording()
        model.set_attention_fn(fn)
        got = model(x, document_ids=IDS)
    assert torch.equal(got, want)
    assert len(fn.calls) == model.cfg.n_layers
    for call in fn.calls:
        assert call["is_causal"] is False
        assert torch.equal(call["attn_mask"], reference_mask("documents"))
    # A block given its own kernel beside a model that built the BlockMask still gets the
    # dense mask: built from the document ids on the spot.
    model.set_attention_fn(None)
    documents = DocumentMask.build(IDS, "flex", compile=False)
    block, fn = model.blocks[0].attn, Recording()
    block.attention_fn = fn
    h = model.wte(x)
    cos, sin = model.rope(0, T)
    with torch.no_grad():
        block(h, cos, sin, documents=documents)
    (call,) = fn.calls
    assert torch.equal(call["attn_mask"], reference_mask("documents"))


def test_a_soft_capped_model_refuses_an_injected_kernel_in_one_line():
    model = Transformer(tiny(attn_logit_softcap=30.0))
    with pytest.raises(ConfigError, match=r"model\.attn_logit_softcap=30\.0") as err:
        model.set_attention_fn(Recording())
    assert "\n" not in str(err.value)
    model.set_attention_fn(None)  # the default kernel is always accepted
    x = torch.randint(0, 96, (B, T))
    model.blocks[1].attn.attention_fn = Recording()  # past the check: refused at the forward
    with pytest.raises(ConfigError, match="set_attention_fn"):
        model(x)
    with pytest.raises(ConfigError, match="set_attention_fn"):
        model(x, document_ids=IDS)


def test_the_planner_still_traces_a_soft_capped_model_for_a_gpu():
    """The planner injects FlashAttention's memory for target="cuda"; with a soft cap it traces
    the unfused path, which is what runs there (as before, when the injection was ignored)."""
    from pretrain.planner.trace import trace_train

    train, forward = trace_train(tiny(attn_logit_softcap=30.0), 2, 32, torch.bfloat16, 0)
    assert train >= forward > 0
