"""What a data.train / data.valid entry names: its .bin/.idx prefixes, checked, and their tokenizer.

An entry is either
  - a folder written by tools/prepare_data.py (holding manifest.json and shards), or its parent
    (OUT resolves to OUT/train for data.train and OUT/valid for data.valid): its shards, each
    checked against the manifest;
  - a megatron-core prefix PREFIX (PREFIX.bin + PREFIX.idx), e.g. made by GPT-NeoX's or
    Megatron-LM's preprocess_data.py.
Every pair is checked before megatron-core reads it (`check_prefix`: .idx header and .bin size
agree), so damaged or partial data is one line naming the file and the fix (`DataError`).
`resolve_split` spreads each entry's weight over its shards by tokens (the blend megatron
builds, pretrain/data/dataset.py); `tokenizer_for_data` is data.tokenizer or the one saved
with the data, refused when a manifest records another.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.megatron_compat import import_quietly
from pretrain.data.shards import MANIFEST, PrepareError, read_manifest
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.errors import UserError

_IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


class DataError(UserError, ValueError):
    """Training data is missing, incomplete or damaged; the message names the file and the fix."""

    label = "data error"


# ----------------------------------------------------------------------------- resolving entries


@dataclass
class Prefix:
    """One .bin/.idx pair and what it holds."""

    path: str  # absolute prefix, without .bin/.idx
    tokens: int
    documents: int
    manifest: dict | None  # the prepared folder's manifest, when it came from one
    folder: Path | None


def check_prefix(prefix: str | Path, key: str = "data") -> tuple[int, int]:
    """(tokens, documents) of an indexed dataset, after checking that .idx and .bin agree.

    megatron-core asserts (or reads garbage) on a damaged pair; this says what is wrong.
    """
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for p in (idx, bin_):
        if not p.is_file():
            raise DataError(
                f"{key}: {p} not found; a data prefix needs both {idx.name} and {bin_.name}"
            )
    size = idx.stat().st_size
    if size < IDX_HEADER:
        raise DataError(
            f"{key}: {idx} is {'empty' if size == 0 else 'truncated'} ({size} bytes); prepare the data again"
        )
    with open(idx, "rb") as f:
        head = f.read(IDX_HEADER)
    if head[:9] != _IDX_MAGIC:
        raise DataError(f"{key}: {idx} is not a megatron indexed-dataset index (bad header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    DType = import_quietly("megatron.core.datasets.indexed_dataset").DType
    try:
        itemsize = DType.size(code)
    except ValueError:
        raise DataError(f"{key}: {idx} names an unknown token dtype code {code}") from None
    expected = IDX_HEADER + n_seq * 4 + n_seq * 8 + n_doc * 8
    if version != 1 or size not in (expected, expected + n_seq):  # + n_seq: multimodal modes
        raise DataError(
            f"{key}: {idx} is damaged: {size} bytes where its header implies {expected}; "
            f"prepare the data again"
        )
    lengths = np.fromfile(idx, dtype=np.int32, count=n_seq, offset=IDX_HEADER)
    tokens = int(lengths.sum(dtype=np.int64))
    if bin_.stat().st_size != tokens * itemsize:
        raise DataError(
            f"{key}: {bin_} has {bin_.stat().st_size} bytes but {idx.name} describes {tokens} tokens "
            f"x {itemsize} bytes = {tokens * itemsize}: the .bin is truncated or the .idx belongs to "
            f"another dataset; prepare the data again"
        )
    if tokens == 0:
        raise DataError(f"{key}: {prefix} holds no tokens")
    return tokens, max(n_doc - 1, 0)


def _resolve_folder(entry: str, split: str, key: str) -> Path | None:
    p = Path(entry)
    if not p.is_dir():
        return None
    if (p / MANIFEST).is_file():
        return p
    if (p / split / MANIFEST).is_file():
        return p / split
    raise DataError(
        f"{key}: {entry} is a folder without {MANIFEST} (nor {split}/{MANIFEST}); "
        f"prepare it with tools/prepare_data.py, or name a PREFIX of PREFIX.bin/.idx"
    )


def resolve_entry(entry: str, split: str, key: str) -> list[Prefix]:
    """The prefixes behind one data.train / data.valid entry."""
    folder = _resolve_folder(entry, split, key)
    if folder is None:
        prefix = str(Path(entry).expanduser().resolve())
        if prefix.endswith((".bin", ".idx")):
            prefix = prefix[:-4]
        if not (Path(prefix + ".bin").exists() or Path(prefix + ".idx").exists()):
            raise DataError(
                f"{key}: {entry} not found (neither a prepared folder nor a PREFIX.bin/.idx pair)"
            )
        tokens, docs = check_prefix(prefix, key)
        return [Prefix(prefix, tokens, docs, None, None)]
    try:
        manifest = read_manifest(folder)
    except PrepareError as e:
        raise DataError(f"{key}: {e}") from None
    if not manifest.get("complete"):
        raise DataError(
            f"{key}: {folder} is only partly prepared; rerun the same prepare_data.py "
            f"command to finish it (finished shards are kept)"
        )
    if not manifest["shards"]:
        raise DataError(f"{key}: {folder} holds no documents")
    out = []
    for shard in manifest["shards"]:
        prefix = str((folder / shard["prefix"]).resolve())
        tokens, docs = check_prefix(prefix, key)
        if tokens != shard["tokens"]:
            raise DataError(
                f"{key}: {prefix} holds {tokens} tokens but the manifest records "
                f"{shard['tokens']}; prepare the data again"
            )
        out.append(Prefix(prefix, tokens, docs, manifest, folder))
    return out


def resolve_split(
    entries: list[str], weights: list[float] | None, split: str, key: str
) -> tuple[list[str], list[float], list[Prefix]]:
    """Flatten entries into prefixes with weights: each entry's weight spread over its shards by tokens."""
    if weights is not None and len(weights) != len(entries):
        raise DataError(
            f"data.train_weights has {len(weights)} values for {len(entries)} data.train entries; "
            f"give one weight per entry, or null to weight by size"
        )
    if weights is not None and (min(weights, default=0) < 0 or sum(weights) <= 0):
        raise DataError(f"data.train_weights={weights} must be non-negative with a positive sum")
    paths, flat, prefixes = [], [], []
    for i, entry in enumerate(entries):
        parts = resolve_entry(entry, split, f"{key}[{i}]")
        entry_tokens = sum(p.tokens for p in parts)
        w = entry_tokens if weights is None else weights[i]
        if w == 0:
            continue
        for p in parts:
            paths.append(p.path)
            flat.append(w * p.tokens / entry_tokens)
            prefixes.append(p)
    return paths, flat, prefixes


# ----------------------------------------------------------------------------- tokenizer


def _manifests(data: DataConfig) -> list[tuple[str, dict, Path]]:
    out = []
    for split, entries in (("train", data.train), ("valid", data.valid)):
        for i, entry in enumerate(entries):
            folder = _resolve_folder(entry, split, f"data.{split}[{i}]")
            if folder is not None:
                out.append((f"data.{split}[{i}]", read_manifest(folder), folder))
    return out


def tokenizer_for_data(data: DataConfig) -> Tokenizer:
    """The tokenizer of `data`: data.tokenizer, else the one saved with the first prepared entry.

    Refuses data whose manifests record a different tokenizer: training on ids that the model's
    tokenizer would decode differently loses the run silently.
    """
    if not data.train:
        raise DataError("data.train is empty; name at least one prepared folder or data prefix")
    manifests = _manifests(data)
    if data.tokenizer:
        tok = load_tokenizer(data.tokenizer)
        source = f"data.tokenizer={data.tokenizer}"
    elif manifests:
        key, manifest, folder = manifests[0]
        tok = load_tokenizer(folder / manifest.get("tokenizer_dir", "../tokenizer"))
        source = f"the tokenizer saved with {key}"
    else:
        raise DataError(
            "data.tokenizer is null and no data.train entry has a manifest to take it from; "
            "set data.tokenizer (e.g. the tokenizer.json the data was made with)"
        )
    for key, manifest, folder in manifests:
        recorded = manifest["tokenizer"]
        if recorded["sha256"] != tok.sha256:
            raise DataError(
                f"{key}: {folder} was tokenized with {recorded['identifier']} but {source} is "
                f"{tok.identifier}; use the tokenizer the data was prepared with"
            )
    return tok
