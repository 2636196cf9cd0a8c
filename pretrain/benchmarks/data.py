"""Tokenization throughput of tools/prepare_data.py, per worker and in total; hours for 100B tokens.

    python tools/benchmark.py data                         # Pythia tokenizer, real web text, 1 and 2 workers
    python tools/benchmark.py data --workers 1 2 4 --copies 4 --json out.json

What it runs: the real web-text samples in ../shared/data/webtext (FineWeb, FineWeb-Edu, C4,
CCNet; 700 documents, ~0.94M Pythia tokens), written `--copies` times into one jsonl file,
prepared end to end (read, tokenize, append EOD, write .bin/.idx) by `prepare()` with each
worker count. Next to it, the same input through a re-implementation of the loop of
Megatron-LM's / GPT-NeoX's preprocess_data.py (a multiprocessing Pool's imap over
lines, chunksize 25, one `tokenizer.encode(text)` call per document, `add_document` per
document), the reference the issue sets.

Figures: wall-clock tokens/s in total; tokens per CPU-second of the workers and the main
process together (user+sys, from getrusage), which is what one core achieves when it is not
shared, so it stays meaningful on a loaded machine; and the projected hours to prepare 100B
tokens on a node with `--node-cores` cores, from the per-CPU-second figure.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import resource
import tempfile
import time
from pathlib import Path

from pretrain.data.megatron_compat import import_quietly
from pretrain.data.shards import token_dtype
from pretrain.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default=str(SHARED / "tokenizers" / "gpt-neox-20b_tokenizer.json"),
        help="tokenizer spec (default: the Pythia / GPT-NeoX-20B tokenizer.json in ../shared/data)",
    )
    p.add_argument(
        "--webtext",
        default=str(SHARED / "webtext"),
        help="folder of .jsonl/.json(.gz) documents with a 'text' field (default ../shared/data/webtext)",
    )
    p.add_argument(
        "--copies", type=int, default=3, help="times the documents are repeated (default 3)"
    )
    p.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default: 1 2)"
    )
    p.add_argument(
        "--node-cores", type=int, default=64, help="cores of the node to project for (default 64)"
    )
    p.add_argument(
        "--target-tokens", type=float, default=100e9, help="tokens to project for (default 100e9)"
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the preprocess_data.py-style reference"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _cpu_seconds() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _write_input(webtext: Path, copies: int, out: Path) -> tuple[Path, int]:
    docs = []
    for path in sorted(webtext.iterdir()):
        if not path.name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            continue
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f if line.strip()]
    if not docs:
        raise SystemExit(f"no jsonl documents found in {webtext}")
    target = out / "input.jsonl"
    with open(target, "w", encoding="utf-8") as f:
        for _ in range(copies):
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    return target, len(docs) * copies


# ----------------------------------------------------------------------------- reference loop

_REF = None


def _ref_init(spec: str) -> None:
    global _REF
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    _REF = load_tokenizer(spec)


def _ref_encode(line: str) -> tuple[list[int], int]:
    # preprocess_data.py's Encoder.encode: json.loads, tokenize one document, append EOD.
    text = json.loads(line)["text"]
    ids = _REF.encode(text)
    if ids:
        ids.append(_REF.eod_id)
    return ids, len(line)


def _reference(input_path: Path, spec: str, workers: int, out: Path) -> int:
    import numpy as np

    idx_mod = import_quietly("megatron.core.datasets.indexed_dataset")
    dtype = token_dtype(load_tokenizer(spec).vocab_size)
    builder = idx_mod.IndexedDatasetBuilder(str(out / "ref.bin"), dtype=dtype.type)
    tokens = 0
    with (
        open(input_path, encoding="utf-8") as fin,
        mp.get_context("fork").Pool(workers, _ref_init, (spec,)) as pool,
    ):
        for ids, _ in pool.imap(_ref_encode, fin, 25):
            if ids:
                builder.add_document(np.asarray(ids), [len(ids)])
                tokens += len(ids)
    builder.finalize(str(out / "ref.idx"))
    return tokens


# ----------------------------------------------------------------------------- run


def _measure(fn) -> tuple[int, float, float]:
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0, _cpu_seconds() - cpu0


def run(args: argparse.Namespace) -> None:
    from pretrain.data.prepare import prepare

    import_quietly("megatron.core.datasets.indexed_dataset")  # imports are not part of the timing
    tok = load_tokenizer(args.tokenizer)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        input_path, n_docs = _write_input(Path(args.webtext), args.copies, tmp)
        print(
            f"input: {n_docs} documents ({input_path.stat().st_size / 1e6:.1f} MB of jsonl), "
            f"tokenizer {tok.identifier}; {os.cpu_count()} CPUs here, load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        runs = [("prepare_data", w) for w in args.workers]
        if not args.no_baseline:
            runs += [("preprocess_data-style", w) for w in args.workers]
        for kind, w in runs:
            out = tmp / f"{kind}_{w}"
            out.mkdir()
            if kind == "prepare_data":

                def fn(out=out, w=w):
                    m = prepare(out, tok, inputs=[str(input_path)], workers=w, progress=False)
                    return m["train"]["tokens"]
            else:

                def fn(out=out, w=w):
                    return _reference(input_path, args.tokenizer, w, out)

            tokens, wall, cpu = _measure(fn)
            per_cpu = tokens / cpu
            hours = args.target_tokens / (per_cpu * args.node_cores) / 3600
            r = {
                "pipeline": kind,
                "workers": w,
                "tokens": tokens,
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "tokens_per_s": round(tokens / wall),
                "tokens_per_s_per_worker": round(tokens / wall / w),
                "tokens_per_cpu_s": round(per_cpu),
                f"hours_{args.target_tokens:.0e}_tokens_{args.node_cores}_cores": round(hours, 2),
            }
            results.append(r)
            print(
                f"{kind:>22} workers={w}: {tokens:,} tokens in {wall:.1f} s wall = {tokens / wall:,.0f} tokens/s "
                f"({tokens / wall / w:,.0f} per worker); {per_cpu:,.0f} tokens per CPU-second -> "
                f"{hours:.1f} h for {args.target_tokens:.0e} tokens on {args.node_cores} cores"
            )
    ours = {r["workers"]: r for r in results if r["pipeline"] == "prepare_data"}
    for r in results:
        if r["pipeline"] != "prepare_data" and r["workers"] in ours:
            ratio = ours[r["workers"]]["tokens_per_cpu_s"] / r["tokens_per_cpu_s"]
            print(
                f"workers={r['workers']}: prepare_data does {ratio:.2f}x the tokens per CPU-second of the "
                f"preprocess_data.py-style loop"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
