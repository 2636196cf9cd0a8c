"""Train a tokenizer on a corpus: byte-level BPE (as GPT-NeoX-20B / Pythia) or SentencePiece.

    tok = train_tokenizer(["corpus/*.jsonl"], "my_tokenizer", kind="bpe", vocab_size=32000)
    load_tokenizer("my_tokenizer")  # a saved tokenizer folder, usable by prepare_data.py

Reads documents with the same readers as prepare_data.py (parquet, jsonl(.gz), txt), up to
`max_bytes` of text, in input order, so the same inputs train the same tokenizer.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

from pretrain.data.sources import expand_inputs, iter_units, open_source, read_unit
from pretrain.data.tokenizer import (
    EOD_TEXT,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
)

log = logging.getLogger(__name__)

KINDS = ("bpe", "sentencepiece-bpe", "sentencepiece-unigram")


def iter_texts(
    inputs: list[str],
    text_field: str = "text",
    txt_mode: str = "file",
    max_bytes: int | None = None,
) -> Iterator[str]:
    """Documents of the inputs, in order, stopping after about `max_bytes` of UTF-8."""
    sources = [open_source(p, text_field, txt_mode) for p in expand_inputs(inputs)]
    seen = 0
    for unit in iter_units(sources, 256):
        for text in read_unit(unit.payload):
            if not text:
                continue
            yield text
            seen += len(text.encode("utf-8"))
            if max_bytes is not None and seen >= max_bytes:
                return


def _train_bpe(texts: Iterator[str], vocab_size: int, name: str) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    # The GPT-NeoX-20B recipe: NFC, byte-level pre-tokenization, <|endoftext|> and <|padding|> first.
    tok = RustTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TEXT, "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str().encode(), name, EOD_TEXT)


def _train_sentencepiece(
    texts: Iterator[str], vocab_size: int, model_type: str, name: str
) -> Tokenizer:
    import sentencepiece as spm

    def lines() -> Iterator[str]:  # SentencePiece learns from sentences: feed non-empty lines
        for text in texts:
            yield from (line for line in text.split("\n") if line.strip())

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,  # any UTF-8 text round-trips, as in Llama's tokenizer
            character_coverage=0.9995,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
            minloglevel=2,
        )
    except RuntimeError as e:
        raise TokenizerError(f"SentencePiece training failed: {e}") from None
    return SentencePieceTokenizer(model.getvalue(), name)


def train_tokenizer(
    inputs: list[str],
    output: str | Path,
    kind: str = "bpe",
    vocab_size: int = 32000,
    text_field: str = "text",
    txt_mode: str = "file",
    max_bytes: int | None = 1_000_000_000,
    name: str | None = None,
) -> Tokenizer:
    """Train and save into `output` (a folder `load_tokenizer` reads). Returns the tokenizer."""
    if kind not in KINDS:
        raise TokenizerError(f"--kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    if vocab_size < 260 and kind == "bpe":
        raise TokenizerError(
            f"--vocab-size {vocab_size} is below the 256 bytes + special tokens of byte-level BPE"
        )
    name = name or Path(output).name
    texts = iter_texts(inputs, text_field, txt_mode, max_bytes)
    if kind == "bpe":
        tok = _train_bpe(texts, vocab_size, name)
    else:
        tok = _train_sentencepiece(texts, vocab_size, kind.split("-")[1], name)
    tok.save(output)
    log.info("trained %s (vocab %d) -> %s", tok.identifier, tok.vocab_size, output)
    return tok
