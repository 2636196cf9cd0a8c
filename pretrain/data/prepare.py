"""Corpus -> tokenized megatron-core indexed dataset shards (.bin/.idx) with a manifest per split.

An output folder OUT holds:

    OUT/tokenizer/                      the tokenizer (load_tokenizer("OUT/tokenizer"))
    OUT/train/shard_00000.{bin,idx}     megatron-core IndexedDataset shards (GPT-NeoX/Megatron-LM
    OUT/train/manifest.json             read them as data prefixes OUT/train/shard_00000)
    OUT/valid/...                       with --valid-fraction > 0 (document-disjoint from train)

This module runs a preparation (`prepare`, `run_units`); the input is read by sources.py, the
units tokenized by tokenize_workers.py, and the shards and manifests written by shards.py.

How it stays exact, parallel and resumable:
- The input is read in *units* (sources.py) in an order fixed by the input alone. Worker
  processes tokenize units (batched, in Rust for tokenizer.json); the main process writes the
  results strictly in unit order, so 1 or 64 workers write the same bytes.
- Each document gets one end-of-document id appended (none for character-level data).
- Train/valid is decided per document by a hash of its text: document-disjoint, independent
  of order and worker count, and exact duplicates land in the same split.
- When a split's open shard passes `shard_tokens` tokens, every split closes its open shard at
  that unit boundary (so a small validation split never holds the resume point back). Files
  are written under temporary names and renamed, then each manifest records its shards and
  the next unit to read. A rerun checks the manifests, keeps finished shards and continues
  from there, so an interrupted run ends with the same files as an uninterrupted one.
- A document whose text is null or missing, or empty, is skipped; every manifest counts them
  (`skipped_documents`, over the input units before `next_unit`). A text that is not a string
  stops the run with an error naming the file and line (sources.py).
- SIGINT/SIGTERM (tokenize_workers.stop_on_signals, used by tools/prepare_data.py) stop the
  run cleanly: the workers are terminated without tracebacks and the finished shards are kept.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain.data.shards import (
    FORMAT,
    TOKENIZER_DIR,
    PrepareError,
    SplitWriter,
    check_existing,
    overwrite_splits,
    remove_stale,
    save_tokenizer,
    token_dtype,
)
from pretrain.data.sources import (
    Unit,
    count_units,
    expand_inputs,
    hf_units,
    iter_units,
    open_source,
)
from pretrain.data.tokenize_workers import default_workers, encoded_units
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.faults import fault_point

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1_000_000_000  # ~2 GB of uint16 per shard; the index stays small
DEFAULT_DOCS_PER_UNIT = 512


def run_units(
    output: str | Path,
    tok: Tokenizer,
    units: Iterator[Unit],
    *,
    splits: list[str],
    settings: dict,
    sources: list[dict],
    total_units: int | None = None,
    valid_fraction: float = 0.0,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, dict]:
    """Tokenize `units` into OUT/<split>/ shards. Returns the manifest of each split."""
    output = Path(output)
    if overwrite:
        overwrite_splits(output, splits)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = save_tokenizer(output, tok)
    dtype = token_dtype(tok.vocab_size)
    settings = json.loads(
        json.dumps(
            {
                **settings,
                "tokenizer_sha256": tok.sha256,
                "shard_tokens": shard_tokens,
                "dtype": dtype.name,
            }
        )
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    writers: dict[str, SplitWriter] = {}
    for split in splits:
        d = output / split
        d.mkdir(exist_ok=True)
        fresh = {
            "format": FORMAT,
            "split": split,
            "complete": False,
            "created": now,
            "documents": 0,
            "tokens": 0,
            "dtype": dtype.name,
            "tokenizer": tok.describe(),
            "tokenizer_dir": f"../{TOKENIZER_DIR}",
            "sources": sources,
            "settings": settings,
            "shards": [],
        }
        manifest = check_existing(d, fresh, settings)
        remove_stale(d, manifest)
        writers[split] = SplitWriter(d, manifest, dtype, shard_tokens)
    if all(w.manifest["complete"] for w in writers.values()):
        log.info(
            "%s is already prepared (%s); nothing to do",
            output,
            ", ".join(f"{s}: {w.manifest['tokens']:,} tokens" for s, w in writers.items()),
        )
        return {s: w.manifest for s, w in writers.items()}
    start = min(w.resume_unit for w in writers.values())
    if start:
        log.info(
            "resuming %s at input unit %d (finished shards: %s)",
            output,
            start,
            ", ".join(f"{s} {len(w.manifest['shards'])}" for s, w in writers.items()),
        )

    from tqdm import tqdm

    t0 = time.time()
    docs = toks = done = chars = 0
    bar = tqdm(
        total=total_units,
        initial=start if total_units else 0,
        unit="chunk",
        disable=not progress,
        dynamic_ncols=True,
        desc=f"tokenizing -> {output.name}",
    )
    end = start
    results = encoded_units(units, start, workers, tok, tokenizer_dir, valid_fraction, dtype.name)
    try:
        for i, result in results:
            for split, w in writers.items():
                tokens, lengths = result["splits"].get(split, (None, None))
                written = w.add(i, tokens, lengths)
                if written:
                    docs += len(lengths)
                    toks += written
            chars += result["chars"]
            for w in writers.values():
                w.count_skipped(i, {"no_text": result["no_text"], "empty_text": result["empty"]})
            end = i + 1
            if any(w.full for w in writers.values()):
                for w in writers.values():
                    w.checkpoint(end)
            done += 1
            elapsed = max(time.time() - t0, 1e-9)
            bar.update(1)
            bar.set_postfix_str(
                f"{docs / elapsed:,.0f} docs/s, {toks / elapsed:,.0f} tokens/s", refresh=False
            )
            fault_point("prepare_units_written", done)  # the crash tests' kill
    finally:
        results.close()  # on an error or interruption: terminate the workers now
        bar.close()
    seconds = time.time() - t0
    for w in writers.values():
        w.finish(max(end, w.resume_unit), seconds)
    skipped = next(iter(writers.values())).skipped  # input counts: the same in every split
    if skipped["no_text"] or skipped["empty_text"]:
        log.warning(
            "skipped %d documents whose text is null or missing and %d empty documents "
            "(counted in each manifest's skipped_documents)",
            skipped["no_text"],
            skipped["empty_text"],
        )
    if toks:
        log.info(
            "%.1f s for %d tokens (%.0f tokens/s, %.2f characters per token)",
            seconds,
            toks,
            toks / max(seconds, 1e-9),
            chars / toks,
        )
    for split, w in writers.items():
        m = w.manifest
        log.info(
            "%s/%s: %d documents, %d tokens in %d shards",
            output,
            split,
            m["documents"],
            m["tokens"],
            len(m["shards"]),
        )
        if m["documents"] == 0:
            log.warning("%s/%s received no documents", output, split)
    return {s: w.manifest for s, w in writers.items()}


def prepare(
    output: str | Path,
    tokenizer: str | Tokenizer,
    *,
    inputs: list[str] | None = None,
    hf_dataset: str | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    text_field: str = "text",
    txt_mode: str = "file",
    valid_fraction: float = 0.0,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    docs_per_unit: int = DEFAULT_DOCS_PER_UNIT,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, dict]:
    """Tokenize local files (`inputs`: paths, globs or folders) or a Hugging Face dataset."""
    if not 0.0 <= valid_fraction < 1.0:
        raise PrepareError(f"--valid-fraction {valid_fraction} must be in [0, 1)")
    if shard_tokens <= 0 or docs_per_unit <= 0:
        raise PrepareError("--shard-tokens and --docs-per-unit must be positive")
    if (inputs is None) == (hf_dataset is None):
        raise PrepareError("give either --input files or --hf-dataset NAME, not both or neither")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    splits = ["train", "valid"] if valid_fraction > 0 else ["train"]
    settings = {
        "text_field": text_field,
        "valid_fraction": valid_fraction,
        "docs_per_unit": docs_per_unit,
        "txt_mode": txt_mode,
    }
    if inputs is not None:
        files = expand_inputs(inputs)
        srcs = [open_source(p, text_field, txt_mode) for p in files]
        described = [s.describe() for s in srcs]
        settings["inputs"] = described
        units: Iterator[Unit] = iter_units(srcs, docs_per_unit)
        total = count_units(srcs, docs_per_unit)
    else:
        described = [{"hf_dataset": hf_dataset, "config": hf_config, "split": hf_split}]
        settings["inputs"] = described
        units = hf_units(hf_dataset, hf_config, hf_split, text_field, docs_per_unit)
        total = None
    workers = default_workers() if workers is None else max(1, workers)
    log.info(
        "preparing %s -> %s with %s, %d workers",
        f"{len(described)} inputs" if inputs else hf_dataset,
        output,
        tok.identifier,
        workers,
    )
    return run_units(
        output,
        tok,
        units,
        splits=splits,
        settings=settings,
        sources=described,
        total_units=total,
        valid_fraction=valid_fraction,
        workers=workers,
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        progress=progress,
    )
