"""RoPE frequency use of a model: per layer, head and rotary pair, mean ||q_pair|| ||k_pair||.

    python tools/frequency_use.py --run runs/llama1b_rope10 --text book.txt --out fu/rope10
    python tools/frequency_use.py --run runs/x --step 12000 --data data/fineweb --tokens 65536
    python tools/frequency_use.py --hf exports/pythia1b --text book.txt --out fu/pythia

For every layer, query head h and rotary pair j (dims j and j + r/2 of the head's first r =
rotary dims, rotate_half order): the mean over the tokens read of ||q_pair|| x ||k_pair||,
q and k the vectors RoPE rotates (after QK-Norm; k of the head's KV group under GQA), and
each pair's share of the head's total (Barbero et al., ICLR 2025; MHA2MLA's 2-norm score).
Pair j is frequency rank j: j = 0 turns fastest. NoPE layers have no pairs.

Writes OUT/frequency_use.json (the map), frequency_use_layers.png (layers x pairs, heads
pooled) and frequency_use_heads.png (one panel per layer: heads x pairs), and prints one line
per layer. The model: a run's weights (--run, --step) or a Hugging Face folder (--hf, read as
tools/import_hf.py reads it, no code from the folder run). The tokens: a text file (--text,
encoded with the model's tokenizer or --tokenizer) or prepared data (--data, its token ids),
cut into windows of --seq-len. See docs/frequency_use.md.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pretrain.analysis.frequency_use import frequency_use, summary_table, write_frequency_use
from pretrain.cli.errors import ArgumentParser, user_errors
from pretrain.data.dataset import read_token_stream
from pretrain.data.prefixes import DataError, resolve_entry
from pretrain.data.shards import TOKENIZER_DIR
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.errors import UserError
from pretrain.hf.folder import read_hf_folder
from pretrain.model.transformer import Transformer
from pretrain.run_layout import CHECKPOINTS_DIR
from pretrain.weights import find_weights_dir, load_weights

DEFAULT_TOKENS = 16384
LONGEST_DEFAULT_WINDOW = 4096
TEXT_CHUNK = 1 << 20  # characters of --text encoded at a time
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="frequency_use.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--run",
        help="run folder (runs/NAME: its newest checkpoint), a checkpoint folder, or a "
        "weights folder",
    )
    model.add_argument(
        "--hf", help="Hugging Face model folder (config.json + safetensors; Llama, GPT-NeoX, ...)"
    )
    p.add_argument(
        "--step", type=int, default=None, help="with --run: this step's checkpoint, not the newest"
    )
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="a UTF-8 text file, encoded with the model's tokenizer")
    text.add_argument(
        "--data",
        help="prepared data (a folder of tools/prepare_data.py, its valid/ split if it has one, "
        "or a PREFIX of PREFIX.bin/.idx): its first token ids",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer spec for --text (a tokenizer.json, a saved tokenizer folder, 'bytes'); "
        "default: the run's tokenizer/ folder, or the --hf folder's tokenizer.json",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"tokens to average over (fewer if the text is shorter; default {DEFAULT_TOKENS})",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per window (each starts at position 0); default: the run's train.seq_len, "
        f"else model.max_seq_len, at most {LONGEST_DEFAULT_WINDOW} and at most --tokens",
    )
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="weights and activations dtype (default float32; sums are fp64 either way)",
    )
    p.add_argument(
        "--out", required=True, help="output folder: frequency_use.json and the PNG heat maps"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.step is not None and args.run is None:
        p.error("--step goes with --run")
    for flag in ("tokens", "seq_len", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')}={value} must be >= 1")
    return args


def load_model(args: argparse.Namespace) -> tuple[Transformer, Tokenizer | None, str, int]:
    """(model in eval mode, its tokenizer or None, a label, its training length)."""
    if args.hf is not None:
        model, tok, _ = read_hf_folder(args.hf)
        label = Path(args.hf).resolve().name
        return model, tok, f"hf {label}", model.cfg.max_seq_len
    wdir = find_weights_dir(args.run, args.step)
    model, config = load_weights(wdir)
    saved = wdir / TOKENIZER_DIR
    tok = load_tokenizer(saved) if saved.is_dir() and args.tokenizer is None else None
    label = (
        f"{wdir.parent.parent.name}@{wdir.name}"
        if wdir.parent.name == CHECKPOINTS_DIR
        else wdir.name
    )
    train_len = (config.get("train") or {}).get("seq_len") or model.cfg.max_seq_len
    return model, tok, f"run {label}", int(train_len)


def text_tokens(path: str | Path, tok: Tokenizer, limit: int) -> np.ndarray:
    """The first `limit` token ids of the text file, encoded a chunk of lines at a time."""
    parts, have = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        while have < limit:
            chunk = f.read(TEXT_CHUNK)
            if not chunk:
                break
            chunk += f.readline()  # to the end of the line: no word cut in two
            ids = np.asarray(tok.encode(chunk), dtype=np.int64)
            parts.append(ids)
            have += len(ids)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return stream[:limit]


def data_tokens(entry: str, tok: Tokenizer | None, limit: int) -> np.ndarray:
    """The first `limit` token ids of prepared data, after checking its tokenizer is the
    model's (when both are known)."""
    for prefix in resolve_entry(entry, "valid", "--data"):
        recorded = (prefix.manifest or {}).get("tokenizer") or {}
        if tok is not None and recorded.get("sha256") not in (None, tok.sha256):
            raise DataError(
                f"--data: {entry} was tokenized with {recorded.get('identifier')} but the "
                f"model's tokenizer is {tok.identifier}; use data prepared with the model's "
                f"tokenizer"
            )
    return read_token_stream([entry], limit, "--data")


def windows(
    stream: np.ndarray, seq_len: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, mask) batches of consecutive windows; the last window is padded (mask 0)."""
    n = len(stream)
    starts = list(range(0, n, seq_len))
    for b in range(0, len(starts), batch_size):
        group = starts[b : b + batch_size]
        ids = torch.zeros(len(group), min(seq_len, n - group[0]), dtype=torch.long)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for row, s in enumerate(group):
            piece = torch.from_numpy(stream[s : s + seq_len])
            ids[row, : len(piece)] = piece
            mask[row, : len(piece)] = True
        yield ids, mask


@user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.text is not None:
        open(args.text, "rb").close()  # a wrong path: one line now, not after the model loads
    model, tok, source, train_len = load_model(args)
    if args.tokenizer is not None:
        tok = load_tokenizer(args.tokenizer)
    if args.text is not None:
        if tok is None:
            where = "--hf folder has no tokenizer.json" if args.hf else "run has no tokenizer/"
            raise UserError(f"the {where}; pass --tokenizer SPEC (e.g. its tokenizer.json)")
        stream = text_tokens(args.text, tok, args.tokens)
    else:
        stream = data_tokens(args.data, tok, args.tokens)
    if len(stream) == 0:
        raise UserError(f"{args.text or args.data} holds no tokens; give a longer text")
    vocab = model.cfg.vocab_size
    if int(stream.max()) >= vocab:
        raise UserError(
            f"token id {int(stream.max())} is past the model's vocabulary ({vocab} ids): the "
            f"tokens are not the model's; use its tokenizer (--tokenizer) or its data"
        )
    seq_len = args.seq_len or min(train_len, LONGEST_DEFAULT_WINDOW, len(stream))
    limit = model.max_positions
    if limit is not None and seq_len > limit:
        raise UserError(
            f"--seq-len {seq_len} is past the model's learned positions ({limit}); use at most that"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device=device, dtype=DTYPES[args.dtype]).eval()
    batches = math.ceil(math.ceil(len(stream) / seq_len) / args.batch_size)
    bar = tqdm(
        windows(stream, seq_len, args.batch_size),
        total=batches,
        desc="frequency use",
        unit="batch",
        disable=args.no_progress,
    )
    info = {
        "text": str(args.text) if args.text else None,
        "data": str(args.data) if args.data else None,
        "tokenizer": getattr(tok, "identifier", None),
        "seq_len": seq_len,
        "dtype": args.dtype,
        "device": str(device),
    }
    use = frequency_use(model, bar, source=source, info=info)
    files = write_frequency_use(use, args.out)
    print(f"# RoPE frequency use of {source}: {use.tokens:,} tokens, windows of {seq_len}\n")
    print(summary_table(use))
    print()
    for f in files:
        print(f"wrote {f}")
    return 0
