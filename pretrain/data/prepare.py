"""Corpus -> tokenized megatron-core indexed dataset shards (.bin/.idx) with a manifest per split.

An output folder OUT holds:

    OUT/tokenizer/                      the tokenizer (load_tokenizer("OUT/tokenizer"))
    OUT/train/shard_00000.{bin,idx}     megatron-core IndexedDataset shards (GPT-NeoX/Megatron-LM
    OUT/train/manifest.json             read them as data prefixes OUT/train/shard_00000)
    OUT/valid/...                       with --valid-fraction > 0 (document-disjoint from train)

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
- SIGINT/SIGTERM (`stop_on_signals`, used by tools/prepare_data.py) stop the run cleanly:
  the workers are terminated without tracebacks and the finished shards are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pretrain.data.megatron_compat import import_quietly
from pretrain.data.sources import (
    Unit,
    count_units,
    expand_inputs,
    hf_units,
    iter_units,
    open_source,
    read_unit,
)
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.errors import UserError
from pretrain.exit_codes import EXIT_FAILED
from pretrain.faults import fault_point
from pretrain.run_layout import atomic_write

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "pretrain-indexed-shards/v1"
TOKENIZER_DIR = "tokenizer"
DEFAULT_SHARD_TOKENS = 1_000_000_000  # ~2 GB of uint16 per shard; the index stays small
DEFAULT_DOCS_PER_UNIT = 512
# Why input documents were skipped: null or missing text; empty text.
SKIPPED_KEYS = ("no_text", "empty_text")


class PrepareError(UserError, ValueError):
    """Preparation cannot proceed; the message names the file or flag and the fix."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (see `stop_on_signals`); `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Interrupted` in the main process, once.

    The exception unwinds normally: the worker pool is terminated (its workers die silently of
    SIGTERM), the progress bar closes, and nothing half-written is ever recorded in a manifest.
    A second signal while that happens exits at once. A SIGINT that the parent shell ignores
    (a background job) stays ignored.
    """

    def handler(signum, frame):
        for s in handled:
            signal.signal(s, lambda again, _: os._exit(128 + again))  # a second one: exit now
        raise Interrupted(signum)

    handled = [
        s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN
    ]
    previous = {s: signal.signal(s, handler) for s in handled}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects Slurm/cgroup CPU limits
    except AttributeError:
        return os.cpu_count() or 1


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


# ----------------------------------------------------------------------------- worker side

_WORKER_TOKENIZER: Tokenizer | None = None
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the main process dies, even of SIGKILL, so that no
    orphan finishes its unit and prints a BrokenPipeError traceback into a closed pipe."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _init_worker(tokenizer_dir: str | None, parent: int | None = None) -> None:
    global _WORKER_TOKENIZER
    # One thread per worker: parallelism comes from the processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Pool.terminate(): die quietly
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent around the fork
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _die_with_parent()
    if parent is not None and os.getppid() != parent:  # the parent died before prctl
        os._exit(EXIT_FAILED)
    if tokenizer_dir is not None:  # spawned; a forked worker inherited the parent's tokenizer
        _WORKER_TOKENIZER = load_tokenizer(tokenizer_dir)


def in_valid(text: str, valid_fraction: float) -> bool:
    """Document-level split: a hash of the text below `valid_fraction` goes to valid."""
    if valid_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < valid_fraction * 2.0**64


def encode_unit(
    unit: Unit, valid_fraction: float, dtype: str, tokenizer: Tokenizer | None = None
) -> dict:
    """Tokenize one unit: {split: (tokens, doc_lengths)}, plus counts. Runs in a worker."""
    tok = tokenizer or _WORKER_TOKENIZER
    assert tok is not None, "worker not initialised"
    raw = read_unit(unit.payload)
    texts = [t for t in raw if t]  # an empty document would be a lone end-of-document id
    n_chars = sum(map(len, texts))
    no_text = sum(t is None for t in raw)  # null or missing text
    empty = len(raw) - len(texts) - no_text
    by_split: dict[str, list[str]] = {}
    for t in texts:
        split = unit.split or ("valid" if in_valid(t, valid_fraction) else "train")
        by_split.setdefault(split, []).append(t)
    eod = tok.eod_id
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, docs in by_split.items():
        ids = tok.encode_batch_np(docs)
        extra = 0 if eod is None else 1
        lengths = np.fromiter((len(a) + extra for a in ids), dtype=np.int64, count=len(ids))
        tokens = np.empty(int(lengths.sum()), dtype=dtype)
        pos = 0
        for a, n in zip(ids, lengths, strict=True):
            tokens[pos : pos + len(a)] = a
            if extra:
                tokens[pos + n - 1] = eod
            pos += int(n)
        out[split] = (tokens, lengths)
    return {"splits": out, "chars": n_chars, "empty": empty, "no_text": no_text}


# ----------------------------------------------------------------------------- writing


class _SplitWriter:
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


def _check_existing(directory: Path, manifest: dict, settings: dict) -> dict:
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


def _remove_stale(directory: Path, manifest: dict) -> None:
    keep = {s["prefix"] for s in manifest["shards"]}
    for p in directory.glob("shard_*"):
        stem = p.name.split(".")[0]
        if stem not in keep or ".tmp." in p.name:
            p.unlink()


def _save_tokenizer(output: Path, tok: Tokenizer) -> Path:
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


def _overwrite(output: Path, splits: Iterable[str]) -> None:
    import shutil

    for name in [*splits, TOKENIZER_DIR]:
        d = output / name
        if d.is_dir():
            shutil.rmtree(d)


def _iter_results(
    units: Iterator[Unit],
    start: int,
    workers: int,
    tok: Tokenizer,
    tokenizer_dir: Path,
    valid_fraction: float,
    dtype: str,
) -> Iterator[tuple[int, dict]]:
    """(unit index, encoded unit) in unit order, from `start`; `workers` processes encode."""
    todo = ((i, u) for i, u in enumerate(units) if i >= start)
    if workers <= 1:
        old = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, as one worker of a pool
        try:
            for i, u in todo:
                yield i, encode_unit(u, valid_fraction, dtype, tok)
        finally:
            if old is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old
        return
    global _WORKER_TOKENIZER
    fork = "fork" in mp.get_all_start_methods()
    _WORKER_TOKENIZER = tok if fork else None  # forked workers inherit it: no reload per worker
    try:
        # A worker must not run the parent's Python signal handlers (stop_on_signals) before
        # _init_worker replaces them: the signals stay blocked until it has.
        blocked = (
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            if hasattr(signal, "pthread_sigmask")
            else None
        )
        try:
            pool = mp.get_context("fork" if fork else "spawn").Pool(
                workers, _init_worker, (None if fork else str(tokenizer_dir), os.getpid())
            )
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        with pool:
            procs = list(getattr(pool, "_pool", []))  # the workers, to notice one that dies
            pending: deque = deque()
            # Bounded look-ahead: Pool.imap would read the whole input into memory.
            for i, u in todo:
                pending.append((i, pool.apply_async(encode_unit, (u, valid_fraction, dtype))))
                if len(pending) >= 2 * workers + 2:
                    j, res = pending.popleft()
                    yield j, _result(res, procs)
            while pending:
                j, res = pending.popleft()
                yield j, _result(res, procs)
    finally:
        _WORKER_TOKENIZER = None


def _result(res, procs: list) -> dict:
    """res.get(), but a worker that died (out of memory, a signal of its own) is an error, not
    a wait forever for the unit it held: Pool replaces dead workers and loses their tasks."""
    while True:
        try:
            return res.get(timeout=1.0)
        except mp.TimeoutError:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                code = dead[0].exitcode
                how = f"exit code {code}"
                if code < 0:
                    how = f"killed by signal {-code}"
                    with contextlib.suppress(ValueError):
                        how = f"killed by {signal.Signals(-code).name}"
                raise PrepareError(
                    f"a tokenizer worker process died ({how}; out of memory?); rerun "
                    f"the same command to resume, with fewer --workers if memory is short"
                ) from None


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
        _overwrite(output, splits)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = _save_tokenizer(output, tok)
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
    writers: dict[str, _SplitWriter] = {}
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
        manifest = _check_existing(d, fresh, settings)
        _remove_stale(d, manifest)
        writers[split] = _SplitWriter(d, manifest, dtype, shard_tokens)
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
    results = _iter_results(units, start, workers, tok, tokenizer_dir, valid_fraction, dtype.name)
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
