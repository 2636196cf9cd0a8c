"""Tokenizing the input's units in worker processes, the results in unit order.

- `in_valid`: the document-level train/valid split, by a hash of the text (independent of
  order and worker count; exact duplicates land in the same split).
- `encode_unit`: one unit's documents tokenized (batched, in Rust for tokenizer.json), each
  with one end-of-document id appended (none for character-level data); runs in a worker.
- `encoded_units`: (unit index, encoded unit) strictly in unit order from a bounded pool of
  workers (forked, inheriting the tokenizer, where the platform allows), so 1 or 64 workers
  give the same results; a worker that dies is an error, not a wait forever.
- `stop_on_signals`: SIGINT/SIGTERM become `Interrupted` in the main process; the workers
  ignore SIGINT and die quietly of the pool's SIGTERM, and of their parent's death.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pretrain.data.shards import PrepareError
from pretrain.data.sources import Unit, read_unit
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.exit_codes import EXIT_FAILED


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


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects Slurm/cgroup CPU limits
    except AttributeError:
        return os.cpu_count() or 1


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


def encoded_units(
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
