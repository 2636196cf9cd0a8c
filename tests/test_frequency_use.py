"""RoPE frequency use (pretrain/analysis/frequency_use.py, tools/frequency_use.py) against a
brute force written here: from transformers' own q_proj/k_proj outputs for a Llama it built,
and from our model's qkv output (QK-Norm applied by hand) for partial RoPE, p-RoPE and a
NoPE layer. Random token ids and a small text file written here: no shared data."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from pretrain.analysis.frequency_use import FrequencyUse, frequency_use
from pretrain.cli.frequency_use import main
from pretrain.config import ModelConfig
from pretrain.data.prepare import prepare
from pretrain.data.tokenizer import ByteTokenizer
from pretrain.hf import read_hf_folder
from pretrain.model.transformer import Transformer
from pretrain.weights import save_weights

REPO = Path(__file__).resolve().parents[1]


def pair_use(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, r: int) -> torch.Tensor:
    """(H, r/2) mean over masked tokens of ||q pair j|| ||k pair j||, pair j = dims (j,
    j + r/2); q (B, T, H, D), k (B, T, KV, D), query head h reads key head h // (H / KV).
    Loops over heads and pairs, fp64."""
    q, k = q.double(), k.double()
    H, KV = q.shape[2], k.shape[2]
    out = torch.zeros(H, r // 2, dtype=torch.float64)
    for h in range(H):
        g = h // (H // KV)
        for j in range(r // 2):
            qn = (q[:, :, h, j] ** 2 + q[:, :, h, j + r // 2] ** 2).sqrt()
            kn = (k[:, :, g, j] ** 2 + k[:, :, g, j + r // 2] ** 2).sqrt()
            out[h, j] = (qn * kn)[mask].mean()
    return out


def random_ids(vocab: int, shape=(3, 24), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, shape, generator=g)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[-1, shape[1] // 2 :] = False  # a padded row: those tokens must not count
    return ids, mask


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A transformers Llama (GQA: 4 query heads, 2 key heads) with random weights, saved."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # every weight random, norms too, so nothing hides
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("llama") / "hf"
    hf.save_pretrained(out)
    return out


def test_matches_transformers_own_q_and_k(llama_folder):
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_folder).eval()
    ours, _, _ = read_hf_folder(llama_folder)
    ids, mask = random_ids(128)
    use = frequency_use(ours, [(ids[:2], mask[:2]), (ids[2:], mask[2:])], source="llama")

    seen: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for name in ("q_proj", "k_proj"):
            module = getattr(layer.self_attn, name)
            hooks.append(
                module.register_forward_hook(
                    lambda m, a, out, key=(name, i): seen.__setitem__(key, out.detach())
                )
            )
    with torch.no_grad():
        hf(ids, attention_mask=mask.long())
    for h in hooks:
        h.remove()

    D = 16
    assert use.tokens == int(mask.sum())
    inv = hf.model.rotary_emb.inv_freq.double()
    for i, layer in enumerate(use.layers):
        q = seen["q_proj", i].view(3, 24, 4, D)
        k = seen["k_proj", i].view(3, 24, 2, D)
        want = pair_use(q, k, mask, D)
        got = torch.tensor(layer.per_head, dtype=torch.float64)
        assert layer.rope and layer.pairs == D // 2 and (layer.heads, layer.kv_heads) == (4, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        # pair j's frequency is transformers' inv_freq[j]
        torch.testing.assert_close(
            torch.tensor(layer.inv_freq, dtype=torch.float64), inv, rtol=1e-6, atol=0
        )
        assert layer.passthrough_per_head == [0.0] * 4  # full RoPE: nothing passes through


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("spectrum", ["neox", "p_rope"])
def test_partial_rope_and_nope_layers_against_our_qkv(spectrum):
    torch.manual_seed(1)
    cfg = ModelConfig(
        vocab_size=128,
        pad_vocab_to_multiple=64,
        n_layers=3,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        max_seq_len=64,
        rope_fraction=0.25,  # head_dim 16: 4 rotary dims, 2 pairs
        rope_spectrum=spectrum,
        rope_theta=500.0,
        nope_layers=[1],
        qk_norm=True,
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids, mask = random_ids(128, seed=2)

    # Brute force: the qkv Linear's output, split and QK-Normed here, by hand.
    raw: dict[int, torch.Tensor] = {}
    hooks = [
        block.attn.qkv.register_forward_hook(
            lambda m, a, out, i=i: raw.__setitem__(i, out.detach())
        )
        for i, block in enumerate(model.blocks)
    ]
    use = frequency_use(model, [(ids, mask)], source="ours")
    for h in hooks:
        h.remove()

    H, KV, D, r = 4, 2, 16, 4
    assert [layer.pairs for layer in use.layers] == [2, 0, 2]
    assert [layer.rope for layer in use.layers] == [True, False, True]
    for i, layer in enumerate(use.layers):
        attn = model.blocks[i].attn
        q, k, _ = raw[i].split([H * D, KV * D, KV * D], dim=-1)
        q = rms(q.reshape(3, 24, H, D), attn.q_norm.weight, attn.q_norm.eps)
        k = rms(k.reshape(3, 24, KV, D), attn.k_norm.weight, attn.k_norm.eps)
        rest_q = q[..., layer.rotary_dims :].norm(dim=-1)
        rest_k = k[..., layer.rotary_dims :].norm(dim=-1).repeat_interleave(H // KV, dim=2)
        rest = (rest_q * rest_k)[mask].mean(0)
        torch.testing.assert_close(
            torch.tensor(layer.passthrough_per_head, dtype=torch.float64), rest, rtol=1e-5, atol=0
        )
        if not layer.rope:  # NoPE: no pairs, reported as such
            assert layer.inv_freq == [] and layer.pooled == [] and layer.pooled_share == []
            assert layer.per_head == [[]] * H and layer.share_per_head == [[]] * H
            continue
        got = torch.tensor(layer.per_head, dtype=torch.float64)
        torch.testing.assert_close(got, pair_use(q, k, mask, r), rtol=1e-5, atol=0)
        # f_j = theta^(-2j/r) (NeoX, over the rotary dims) or theta^(-2j/head_dim) (p-RoPE)
        d = D if spectrum == "p_rope" else r
        want = [500.0 ** (-2 * j / d) for j in range(r // 2)]
        assert layer.inv_freq == pytest.approx(want, rel=1e-6)
        assert layer.wavelengths()[0] == pytest.approx(2 * math.pi)


def test_shares_sum_to_one_and_the_record_is_json(llama_folder, tmp_path):
    model, _, _ = read_hf_folder(llama_folder)
    ids, mask = random_ids(128, seed=3)
    use = frequency_use(model, [(ids, mask)], source="llama", info={"seq_len": 24})
    for layer in use.layers:
        for share, row in zip(layer.share_per_head, layer.per_head, strict=True):
            assert sum(share) == pytest.approx(1.0, abs=1e-12)
            assert share == pytest.approx([x / sum(row) for x in row], rel=1e-12)
        assert sum(layer.pooled_share) == pytest.approx(1.0, abs=1e-12)
        heads = torch.tensor(layer.per_head, dtype=torch.float64)
        assert layer.pooled == pytest.approx(heads.mean(0).tolist(), rel=1e-12)
    record = json.loads(json.dumps(use.to_dict(), allow_nan=False))
    assert set(record) == {"layers", "tokens", "source", "info"}
    assert FrequencyUse.from_dict(record) == use
    # masked tokens do not count: the same map without the padded half of the last row
    alone = frequency_use(model, [ids[:2], ids[2:, :12]], source="llama")
    assert alone.tokens == use.tokens
    for a, b in zip(alone.layers, use.layers, strict=True):
        torch.testing.assert_close(torch.tensor(a.per_head), torch.tensor(b.per_head))


TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity.\n"
) * 6


def test_program_on_a_hf_folder_and_a_run(llama_folder, tmp_path, capsys):
    text = tmp_path / "book.txt"
    text.write_text(TEXT)  # ASCII: byte ids below the model's 128
    out = tmp_path / "fu"
    args = ["--text", str(text), "--tokenizer", "bytes", "--tokens", "300", "--seq-len", "64"]
    assert main(["--hf", str(llama_folder), *args, "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "frequency_use.json").read_text())
    assert record["tokens"] == 300 and record["source"] == "hf hf"
    assert record["info"]["seq_len"] == 64 and len(record["layers"]) == 2
    for png in ("frequency_use_layers.png", "frequency_use_heads.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "300 tokens" in printed and "wrote" in printed

    # A run's weights folder, with its own tokenizer/ and a NoPE layer.
    model, _, _ = read_hf_folder(llama_folder)
    model = Transformer(model.cfg.replace(nope_layers=[0], vocab_size=300))  # bytes + eod
    run = tmp_path / "run"
    save_weights(model, run)
    ByteTokenizer().save(run / "tokenizer")
    out2 = tmp_path / "fu_run"
    assert main(["--run", str(run), "--text", str(text), "--out", str(out2), "--no-progress"]) == 0
    record = json.loads((out2 / "frequency_use.json").read_text())
    assert [layer["rope"] for layer in record["layers"]] == [False, True]
    assert record["tokens"] == len(TEXT) and record["source"] == "run run"

    # Prepared data (its valid/ split), made with the run's tokenizer.
    paragraphs = tmp_path / "paragraphs.txt"
    paragraphs.write_text("".join(f"Paragraph {i}: {TEXT[: 60 + i]}\n\n" for i in range(40)))
    data = tmp_path / "data"
    prepare(
        data,
        "bytes",
        inputs=[str(paragraphs)],
        txt_mode="paragraph",
        valid_fraction=0.5,
        workers=1,
        progress=False,
    )
    out3 = tmp_path / "fu_data"
    argv = ["--run", str(run), "--data", str(data), "--tokens", "200", "--out", str(out3)]
    assert main([*argv, "--no-progress"]) == 0
    record = json.loads((out3 / "frequency_use.json").read_text())
    assert record["tokens"] == 200 and record["info"]["data"] == str(data)
    # ... which the 128-id Llama cannot read (its end-of-document id is 256): one line
    capsys.readouterr()
    argv = ["--hf", str(llama_folder), "--data", str(data), "--out", str(tmp_path / "no")]
    assert main(argv) == 2
    assert "token id 256 is past the model's vocabulary" in capsys.readouterr().err


def test_program_refuses_a_bad_path_in_one_line(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    missing = tmp_path / "nowhere"
    assert main(["--hf", str(missing), "--text", str(text), "--out", str(tmp_path / "o")]) == 2
    assert main(["--run", str(missing), "--text", str(text), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(str(missing) in line for line in err), err
    # the launcher: a missing --text, one line, exit 2, before any model is read
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "frequency_use.py"), "--hf", str(tmp_path)]
        + ["--text", str(missing), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("error: ") and str(missing) in res.stderr
    assert not (tmp_path / "o").exists()
