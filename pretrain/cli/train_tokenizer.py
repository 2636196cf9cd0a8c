"""Train a tokenizer on your own corpus; the result is a folder that --tokenizer accepts.

Examples:
  # byte-level BPE like GPT-NeoX-20B / Pythia (NFC, <|endoftext|> = 0), on 1 GB of FineWeb parquet
  python tools/train_tokenizer.py --input 'fineweb/*.parquet' --vocab-size 50277 --output tok/fineweb_bpe
  # SentencePiece BPE with byte fallback (like Llama 2)
  python tools/train_tokenizer.py --input corpus.jsonl --kind sentencepiece-bpe --vocab-size 32000 --output tok/sp
Then: python tools/prepare_data.py --tokenizer tok/fineweb_bpe --input ... --output data/...
"""

from __future__ import annotations

import argparse
import logging

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.data.tokenizer_training import KINDS, train_tokenizer


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files, globs (quoted) or folders: .parquet, .jsonl/.json(.gz), .txt(.gz)",
    )
    p.add_argument(
        "--output", required=True, metavar="DIR", help="folder to write the tokenizer into"
    )
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="bpe",
        help="bpe: byte-level BPE in a tokenizer.json (GPT-NeoX style, default); "
        "sentencepiece-bpe / sentencepiece-unigram: a SentencePiece .model with byte fallback",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="vocabulary size including special tokens (default 32000)",
    )
    p.add_argument(
        "--text-field", default="text", help="field/column with the text (default: text)"
    )
    p.add_argument(
        "--txt-mode",
        choices=("file", "line", "paragraph"),
        default="file",
        help="what one document is in a .txt input (default: the whole file)",
    )
    p.add_argument(
        "--max-bytes",
        type=float,
        default=1e9,
        help="train on the first this-many bytes of text (default 1e9; 0 = all)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    tok = train_tokenizer(
        args.input,
        args.output,
        args.kind,
        args.vocab_size,
        args.text_field,
        args.txt_mode,
        int(args.max_bytes) or None,
    )
    print(
        f"{tok.identifier}: vocab {tok.vocab_size}, end-of-document id {tok.eod_id} -> {args.output}"
    )
    return 0
