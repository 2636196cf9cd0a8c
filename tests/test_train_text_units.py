"""Training reports bits per byte, and bits per character for character-level data."""

from __future__ import annotations

import torch

from pretrain.data.tokenizer import CharTokenizer, load_tokenizer
from pretrain.eval.metrics import text_per_token


def test_char_level_data_gets_bits_per_char_and_bytes_differ():
    text = "naïve café, größer: ½ of ∑\n" * 20
    tok = CharTokenizer(sorted(set(text)))
    ids = torch.tensor(tok.encode(text))
    valid = [{"input_ids": ids[i : i + 64]} for i in range(0, len(ids) - 64, 64)]
    out = text_per_token(tok, valid)
    seen = "".join(tok.decode(v["input_ids"].tolist()) for v in valid)
    assert out["chars_per_token"] == 1.0
    assert abs(out["bytes_per_token"] - len(seen.encode()) / len(seen)) < 1e-12
    assert out["bytes_per_token"] > 1.1  # the non-ASCII characters take 2-3 bytes


def test_byte_level_data_gets_bits_per_byte_only():
    tok = load_tokenizer("bytes")
    ids = torch.tensor(tok.encode("plain ascii text " * 10))
    out = text_per_token(tok, [{"input_ids": ids}])
    assert out == {"bytes_per_token": 1.0}
