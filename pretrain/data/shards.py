"""A prepared folder on disk: each split's shards and manifest.json, and resuming from them.

    OUT/tokenizer/                      the tokenizer (load_tokenizer("OUT/tokenizer"))
    OUT/train/shard_00000.{bin,idx}     megatron-core IndexedDataset shards
    OUT/train/manifest.json             the split's shards, settings and the next unit to read
    OUT/valid/...

Here: the manifest's format and reading it (`read_manifest`, also how training finds a
prepared folder), the writer of one split's shards (`SplitWriter`: documents appended in unit
order, each finished shard renamed into place and recorded in the manifest in one write with
the next unit to read), and what a rerun checks before it continues (`check_existing`: same
tokenizer and settings, finished shards whole; `remove_stale`, `save_tokenizer`).
pretrain/data/prepare.py drives them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from pretrain.data.megatron_compat import import_quietly
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.errors import UserError
from pretrain.run_layout import atomic_write

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "pretrain-indexed-shards/v1"
TOKENIZER_DIR = "tokenizer"
# Why input documents were skipped: null or missing text; empty text.
SKIPPED_KEYS = ("no_text", "empty_text")


class PrepareError(UserError, ValueError):
    """Preparation cannot proceed; the message names the file or flag and the fix."""


def progress_summary(output: str | Path) -> str:
    """'3 shards complete (train 2, valid 1)': what an interrupted run keeps in `output`."""
    counts = {}
    for path in sorted(Path(output).glob(f"*/{MANIFEST}")):
        try:
            counts[path.parent.name] = len(read_manifest(path.parent)["shards"])
        except (PrepareError, KeyError, TypeError):
            continue
    total = sum(counts.values())
    detail = f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if len(counts) > 1 else ""
    return f"{total} shard{'' if total == 1 else 's'} complete{detail}"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 below 65500 ids, else int32: megatron-core's own rule (DType.optimal_dtype)."""
    DType = import_quietly("megatron.core.datasets.indexed_dataset").DType
    return np.dtype(DType.optimal_dtype(vocab_size))


def _atomic_write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=2) + "\n")


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PrepareError(
            f"{path} not found: {directory} is not a prepared split folder"
        ) from None
    except ValueError as e:
        raise PrepareError(f"{path}: not valid JSON ({e}); prepare the data again") from None
    if manifest.get("format") != FORMAT:
        raise PrepareError(f"{path}: unknown format {manifest.get('format')!r} (expected {FORMAT})")
    return manifest


class SplitWriter:
    """Writes one split's shards in unit order; records each finished shard in the manifest."""

    def __init__(self, directory: Path, manifest: dict, dtype: np.dtype, shard_tokens: int) -> None:
        self.dir = directory
        self.manifest = manifest
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        shards = manifest["shards"]
        self.resume_unit = manifest.get("next_unit", shards[-1]["end_unit"] if shards else 0)
        self.start_unit = self.resume_unit
        # Input documents skipped in units before next_unit (the same in every split's manifest).
        manifest["skipped_documents"] = {
            **dict.fromkeys(SKIPPED_KEYS, 0),
            **manifest.get("skipped_documents", {}),
        }
        self.skipped = manifest["skipped_documents"]
        self.builder = None
        self.docs = 0
        self.tokens = 0

    def _paths(self, index: int) -> tuple[Path, Path, Path, Path]:
        name = f"shard_{index:05d}"
        return (
            self.dir / f"{name}.bin",
            self.dir / f"{name}.idx",
            self.dir / f"{name}.tmp.bin",
            self.dir / f"{name}.tmp.idx",
        )

    def add(self, unit_index: int, tokens: np.ndarray | None, lengths: np.ndarray | None) -> int:
        """Append one unit's documents; returns the number of tokens written."""
        if unit_index < self.resume_unit:
            return 0  # this split already holds the unit in a finished shard
        written = 0
        if tokens is not None and len(lengths):
            if self.builder is None:
                builder_cls = import_quietly(
                    "megatron.core.datasets.indexed_dataset"
                ).IndexedDatasetBuilder
                _, _, tmp_bin, _ = self._paths(len(self.manifest["shards"]))
                self.builder = builder_cls(str(tmp_bin), dtype=self.dtype.type)
            pos = 0
            for n in lengths.tolist():
                self.builder.add_document(tokens[pos : pos + n], [n])
                pos += n
            written = int(lengths.sum())
            self.docs += len(lengths)
            self.tokens += written
        return written

    def count_skipped(self, unit_index: int, counts: dict[str, int]) -> None:
        if unit_index >= self.resume_unit:  # else counted by the run that wrote the unit
            for key in SKIPPED_KEYS:
                self.skipped[key] += counts[key]

    @property
    def full(self) -> bool:
        return self.tokens >= self.shard_tokens

    def checkpoint(self, next_unit: int) -> None:
        """Close the open shard (if any) and record that units before `next_unit` are done."""
        if self.builder is not None:
            self.close_shard(next_unit)
        else:
            self.manifest["next_unit"] = self.start_unit = next_unit
            _atomic_write_json(self.dir / MANIFEST, self.manifest)

    def close_shard(self, end_unit: int) -> None:
        if self.builder is None:
            return
        index = len(self.manifest["shards"])
        bin_path, idx_path, tmp_bin, tmp_idx = self._paths(index)
        self.builder.finalize(str(tmp_idx))
        for p in (tmp_bin, tmp_idx):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
        self.manifest["shards"].append(
            {
                "prefix": bin_path.stem,
                "documents": self.docs,
                "tokens": self.tokens,
                "start_unit": self.start_unit,
                "end_unit": end_unit,
                "bin_bytes": bin_path.stat().st_size,
                "idx_bytes": idx_path.stat().st_size,
                "skipped_before_end": dict(self.skipped),  # where a resume from end_unit restarts
            }
        )
        self.manifest["next_unit"] = end_unit  # in the same write as the shard: never apart
        self._update_totals()
        _atomic_write_json(self.dir / MANIFEST, self.manifest)
        self.builder, self.docs, self.tokens, self.start_unit = None, 0, 0, end_unit

    def finish(self, end_unit: int, seconds: float) -> None:
        self.close_shard(end_unit)
        self.manifest["next_unit"] = end_unit
        self._update_totals()
        self.manifest["complete"] = True
        self.manifest["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.manifest["seconds"] = round(seconds, 1)
        _atomic_write_json(self.dir / MANIFEST, self.manifest)

    def _update_totals(self) -> None:
        shards = self.manifest["shards"]
        self.manifest["documents"] = sum(s["documents"] for s in shards)
        self.manifest["tokens"] = sum(s["tokens"] for s in shards)


def check_existing(directory: Path, manifest: dict, settings: dict) -> dict:
    """The manifest to continue from: verified finished shards, or a fresh one."""
    path = directory / MANIFEST
    if not path.is_file():
        return manifest
    old = read_manifest(directory)
    old_tok, new_tok = old["settings"].get("tokenizer_sha256"), settings["tokenizer_sha256"]
    if old_tok != new_tok:
        raise PrepareError(
            f"{path} was prepared with tokenizer {old['tokenizer']['identifier']} but this run "
            f"uses {manifest['tokenizer']['identifier']}; pass a new --output, or --overwrite to replace it"
        )
    if old["settings"] != settings:
        diff = sorted(
            k
            for k in set(old["settings"]) | set(settings)
            if old["settings"].get(k) != settings.get(k)
        )
        raise PrepareError(
            f"{path} was prepared with different settings ({', '.join(diff)}); pass the same "
            f"flags to resume, a new --output, or --overwrite to replace it"
        )
    kept = []
    for shard in old["shards"]:  # a shard counts only when both files are whole
        b, i = directory / f"{shard['prefix']}.bin", directory / f"{shard['prefix']}.idx"
        if not (
            b.is_file()
            and i.is_file()
            and b.stat().st_size == shard["bin_bytes"]
            and i.stat().st_size == shard["idx_bytes"]
        ):
            log.warning(
                "%s: shard %s is missing or damaged; rewriting from there",
                directory,
                shard["prefix"],
            )
            break
        kept.append(shard)
    if len(kept) < len(old["shards"]):
        old["complete"] = False
        old["next_unit"] = kept[-1]["end_unit"] if kept else 0
        # Skipped documents are counted again from the resume point on.
        old["skipped_documents"] = dict(kept[-1].get("skipped_before_end", {})) if kept else {}
    old["shards"] = kept
    return old


def remove_stale(directory: Path, manifest: dict) -> None:
    keep = {s["prefix"] for s in manifest["shards"]}
    for p in directory.glob("shard_*"):
        stem = p.name.split(".")[0]
        if stem not in keep or ".tmp." in p.name:
            p.unlink()


def save_tokenizer(output: Path, tok: Tokenizer) -> Path:
    tdir = output / TOKENIZER_DIR
    if (tdir / "tokenizer_meta.json").is_file():
        existing = load_tokenizer(tdir)
        if existing.sha256 != tok.sha256:
            raise PrepareError(
                f"{output} holds data prepared with tokenizer {existing.identifier} but this run uses "
                f"{tok.identifier}; pass a new --output, or --overwrite to replace it"
            )
        return tdir
    return tok.save(tdir)


def overwrite_splits(output: Path, splits: Iterable[str]) -> None:
    import shutil

    for name in [*splits, TOKENIZER_DIR]:
        d = output / name
        if d.is_dir():
            shutil.rmtree(d)
