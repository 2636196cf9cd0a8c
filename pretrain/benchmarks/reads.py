"""Cold-cache sample reads through our loader, per data.read_mode, on a large sparse dataset.

    python tools/benchmark.py reads                       # 20 GB apparent, ~1 MB on disk; < 2 min
    python tools/benchmark.py reads --full                # 200 GB apparent (100B uint16 tokens)
    python tools/benchmark.py reads --dir /scratch --samples 4000 --json out.json

It writes PREFIX.bin as a sparse file (`truncate`: the apparent size, almost nothing on disk)
and a real PREFIX.idx describing documents of --doc-tokens tokens each, builds the training
samples with build_datasets (megatron-core's GPTDataset: seq 2048, so a sample is 4 KiB of
uint16 tokens at a shuffled position) and reads --samples of them in training order, per
mode in interleaved rounds. Before each read the file's pages are dropped
(posix_fadvise(POSIX_FADV_DONTNEED) while nothing maps them), so each read starts cold.
Figures: samples/s, and the growth of the page cache ("Cached:" in /proc/meminfo) per
sample; medians over rounds. A sparse file's holes are read as zero pages without disk I/O,
so samples/s here measures the page-cache work the read-ahead causes, not a disk's latency;
the page-cache growth per sample is what a real disk would have to deliver.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.megatron_compat import import_quietly

MODES = ("readahead", "random", "file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="data.read_mode values to compare",
    )
    p.add_argument(
        "--gb", type=float, default=20.0, help="apparent size of the .bin in GB (default 20)"
    )
    p.add_argument("--full", action="store_true", help="200 GB apparent (100B uint16 tokens)")
    p.add_argument(
        "--doc-tokens", type=int, default=1 << 20, help="tokens per document (default 2^20)"
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument(
        "--samples", type=int, default=1500, help="samples read per round (default 1500)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--dir", default=None, help="where to write the sparse dataset (default: the temp dir)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def write_sparse_dataset(prefix: Path, tokens: int, doc_tokens: int) -> None:
    """PREFIX.bin: `tokens` uint16 zeros as a hole; PREFIX.idx: megatron's index (version 1)."""

    DType = import_quietly("megatron.core.datasets.indexed_dataset").DType
    n = tokens // doc_tokens
    tokens = n * doc_tokens
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * 2)
    lengths = np.full(n, doc_tokens, dtype=np.int32)
    pointers = np.arange(n, dtype=np.int64) * doc_tokens * 2
    doc_idx = np.arange(n + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(
            b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, DType.code_from_dtype(np.uint16), n, n + 1)
        )
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def _cached_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached: in /proc/meminfo")


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(args: argparse.Namespace) -> None:
    from pretrain.data.dataset import build_datasets

    gb = 200.0 if args.full else args.gb
    tokens = int(gb * 1e9 / 2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        prefix = Path(tmp) / "sparse"
        write_sparse_dataset(prefix, tokens, args.doc_tokens)
        bin_path = f"{prefix}.bin"
        st = os.stat(bin_path)
        print(
            f"{bin_path}: {st.st_size / 1e9:.1f} GB apparent, {st.st_blocks * 512 / 1e6:.2f} MB on disk; "
            f"building the sample index...",
            flush=True,
        )
        t0 = time.perf_counter()

        def build(mode: str):
            data = DataConfig(train=[str(prefix)], tokenizer="bytes", read_mode=mode)
            return build_datasets(
                data, args.seq_len, seed=1, train_samples=args.samples, valid_samples=0
            )[0]

        ref = build("readahead")
        n_samples = len(ref)
        print(
            f"  {n_samples:,} samples of {args.seq_len} tokens (index built in {time.perf_counter() - t0:.0f} s)"
        )
        del ref
        rows: dict[str, dict[str, list[float]]] = {
            m: {"rate": [], "growth": []} for m in args.modes
        }
        for r in range(args.rounds):
            for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
                ds = build(mode)
                gc.collect()
                _drop(bin_path)
                c0, t0 = _cached_bytes(), time.perf_counter()
                for i in range(args.samples):
                    ds[i]  # noqa: B018 (the read is the point)
                dt, grown = time.perf_counter() - t0, _cached_bytes() - c0
                rows[mode]["rate"].append(args.samples / dt)
                rows[mode]["growth"].append(grown / args.samples)
                del ds
                gc.collect()
            _drop(bin_path)
        _drop(bin_path)
    print(
        f"\ncold-cache reads, {gb:g} GB sparse .bin on {args.dir or tempfile.gettempdir()}, {args.samples} samples "
        f"of {args.seq_len} tokens per round, medians of {args.rounds} interleaved rounds; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'read_mode':>10} {'samples/s':>10} {'page cache/sample':>18} {'vs first':>9}")
    results, base = [], None
    for mode in args.modes:
        rate, growth = (
            statistics.median(rows[mode]["rate"]),
            statistics.median(rows[mode]["growth"]),
        )
        base = base or rate
        results.append(
            {
                "read_mode": mode,
                "samples_per_s": round(rate, 1),
                "cache_bytes_per_sample": round(growth),
                "speedup_vs_first": round(rate / base, 2),
            }
        )
        print(f"{mode:>10} {rate:10,.0f} {growth / 1024:15,.1f} KiB {rate / base:8.2f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"gb": gb, "samples": args.samples, "results": results}, indent=1) + "\n"
        )
