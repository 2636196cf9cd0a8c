"""Tokenize a corpus into megatron-core indexed dataset shards (.bin/.idx) with manifests.

Examples:
  # FineWeb sample-100BT with the Pythia (GPT-NeoX-20B) tokenizer, 1% held out for validation
  python tools/prepare_data.py --hf-dataset HuggingFaceFW/fineweb --hf-config sample-100BT \\
      --tokenizer EleutherAI/gpt-neox-20b --valid-fraction 0.01 --output data/fineweb100B
  # the same from downloaded parquet shards
  python tools/prepare_data.py --input 'fineweb/sample/100BT/*.parquet' \\
      --tokenizer gpt-neox-20b_tokenizer.json --valid-fraction 0.01 --output data/fineweb100B
  # ready-made corpora
  python tools/prepare_data.py --recipe stdlib --output data/stdlib
  python tools/prepare_data.py --recipe tinyshakespeare --input input.txt --output data/shakespeare_char
  python tools/prepare_data.py --recipe enwik8 --input enwik8.zip --output data/enwik8

Output: OUT/tokenizer/, OUT/train/shard_NNNNN.{bin,idx} + manifest.json, OUT/valid/... .
Rerunning the same command resumes an interrupted run and skips finished shards; Ctrl-C or
SIGTERM stops cleanly (exit 130 / 143). Documents whose text is null, missing or empty are
skipped and counted in the manifests (skipped_documents).
Use OUT (or OUT/train) in data.train of a run config.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.data import recipes
from pretrain.data.prepare import DEFAULT_DOCS_PER_UNIT, DEFAULT_SHARD_TOKENS, prepare
from pretrain.data.shards import PrepareError, progress_summary
from pretrain.data.tokenize_workers import stop_on_signals

RECIPES = ("stdlib", "tinyshakespeare", "enwik8", "text8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("input (one of)")
    src.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="local files, globs (quote them) or folders: .parquet, .jsonl/.json(.gz) with "
        "one JSON object per line, or .txt(.gz); read in the order given, each glob sorted",
    )
    src.add_argument(
        "--hf-dataset",
        metavar="NAME",
        help="a Hugging Face dataset, streamed (needs the network), e.g. HuggingFaceFW/fineweb",
    )
    src.add_argument("--hf-config", metavar="NAME", help="its configuration, e.g. sample-100BT")
    src.add_argument(
        "--hf-split", default="train", metavar="NAME", help="its split (default: train)"
    )
    src.add_argument(
        "--recipe",
        choices=RECIPES,
        help="a ready-made corpus: stdlib (byte-level, this Python's standard library; needs no "
        "input), tinyshakespeare (--input input.txt), enwik8 / text8 (--input the .zip); "
        "character-level recipes build their own vocabulary",
    )
    p.add_argument(
        "--output", required=True, metavar="DIR", help="output folder (created; rerun to resume)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="tokenizer.json, SentencePiece .model, a saved tokenizer folder, 'bytes', or a hub "
        "name such as EleutherAI/gpt-neox-20b (online); required unless --recipe",
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="field/column holding the document text (default: text)",
    )
    p.add_argument(
        "--txt-mode",
        choices=("file", "line", "paragraph"),
        default="file",
        help="what one document is in a .txt input: the whole file (default), each line, or "
        "each blank-line-separated paragraph",
    )
    p.add_argument(
        "--valid-fraction",
        type=float,
        default=0.0,
        help="fraction of documents held out in OUT/valid, chosen by a hash of each document's "
        "text (document-disjoint, independent of worker count); default 0: train only",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes (default: all CPU cores available to this process)",
    )
    p.add_argument(
        "--shard-tokens",
        type=float,
        default=DEFAULT_SHARD_TOKENS,
        help="start a new shard after this many tokens (default 1e9 = 2 GB of uint16); keeps "
        "every index small",
    )
    p.add_argument(
        "--docs-per-unit",
        type=int,
        default=DEFAULT_DOCS_PER_UNIT,
        help="documents per work unit for jsonl/txt input (parquet units are row groups); the "
        "unit is the granularity of parallelism and of resuming",
    )
    p.add_argument(
        "--max-bytes",
        type=float,
        default=4e6,
        help="--recipe stdlib only: bytes of source to take (default 4e6)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete this output's splits and tokenizer first instead of resuming",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    return p.parse_args(argv)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    progress = not args.no_progress
    try:
        with stop_on_signals():
            _prepare(args, progress)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(
            f"interrupted by {signal.Signals(signum).name}; {progress_summary(args.output)}; "
            f"rerun the same command to resume",
            file=sys.stderr,
        )
        return 128 + signum
    return 0


def _prepare(args: argparse.Namespace, progress: bool) -> None:
    out = Path(args.output)
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            where = "" if folder == out else f" (in --output {out})"
            raise PrepareError(
                f"--output: {folder}{where} is a file, not a folder; choose a folder path"
            )
    if args.recipe == "stdlib":
        recipes.prepare_stdlib_corpus(
            args.output,
            int(args.max_bytes),
            workers=args.workers or 1,
            progress=progress,
            overwrite=args.overwrite,
        )
    elif args.recipe:
        if not args.input or len(args.input) != 1:
            raise PrepareError(f"--recipe {args.recipe} needs --input with its one file")
        fn = {
            "tinyshakespeare": recipes.prepare_tinyshakespeare,
            "enwik8": recipes.prepare_enwik8,
            "text8": recipes.prepare_text8,
        }[args.recipe]
        fn(args.output, args.input[0], progress=progress, overwrite=args.overwrite)
    else:
        if not args.tokenizer:
            raise PrepareError("--tokenizer is required (e.g. path/to/tokenizer.json or 'bytes')")
        prepare(
            args.output,
            args.tokenizer,
            inputs=args.input,
            hf_dataset=args.hf_dataset,
            hf_config=args.hf_config,
            hf_split=args.hf_split,
            text_field=args.text_field,
            txt_mode=args.txt_mode,
            valid_fraction=args.valid_fraction,
            workers=args.workers,
            shard_tokens=int(args.shard_tokens),
            docs_per_unit=args.docs_per_unit,
            overwrite=args.overwrite,
            progress=progress,
        )
