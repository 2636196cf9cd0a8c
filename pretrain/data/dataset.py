"""Training samples from prepared data, through megatron-core's GPTDataset and blending.

    train_ds, valid_ds = build_datasets(cfg.data, seq_len=2048, seed=1234,
                                        train_samples=iters * gbs, valid_samples=n)
    train_ds[i]  # {"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}
    loader = make_loader(train_ds, global_batch=gbs, micro_batch=mbs, dp_rank=r, dp_world=w,
                         consumed_samples=restored_position, num_workers=cfg.data.num_workers)

Each `data.train` / `data.valid` entry is either
  - a folder written by tools/prepare_data.py (holding manifest.json and shards), or its parent
    (OUT resolves to OUT/train for data.train and OUT/valid for data.valid); its shards join
    the blend with weights proportional to their tokens;
  - a megatron-core prefix PREFIX (PREFIX.bin + PREFIX.idx), e.g. made by GPT-NeoX's or
    Megatron-LM's preprocess_data.py.
Entries are blended by `data.train_weights` (or by their token counts). Samples are seq_len+1
consecutive tokens of the shuffled document stream, crossing document boundaries (megatron's
GPTDataset); the order is fixed by the seed, and megatron caches it beside the data.

The loader's order: global batch g holds samples [c + g*GB, c + (g+1)*GB) where c is
`consumed_samples`; rank r reads only its contiguous slice of GB/world samples, in micro
batches. The same samples are trained on whatever the number of ranks, and a run resumed
at c continues exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.config import ConfigError, DataConfig
from pretrain.data.documents import DocumentSwitches
from pretrain.data.megatron_compat import import_quietly
from pretrain.data.prepare import MANIFEST, PrepareError, read_manifest
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.errors import UserError

log = logging.getLogger(__name__)

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


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
    if size < _IDX_HEADER:
        raise DataError(
            f"{key}: {idx} is {'empty' if size == 0 else 'truncated'} ({size} bytes); prepare the data again"
        )
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEADER)
    if head[:9] != _IDX_MAGIC:
        raise DataError(f"{key}: {idx} is not a megatron indexed-dataset index (bad header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    DType = import_quietly("megatron.core.datasets.indexed_dataset").DType
    try:
        itemsize = DType.size(code)
    except ValueError:
        raise DataError(f"{key}: {idx} names an unknown token dtype code {code}") from None
    expected = _IDX_HEADER + n_seq * 4 + n_seq * 8 + n_doc * 8
    if version != 1 or size not in (expected, expected + n_seq):  # + n_seq: multimodal modes
        raise DataError(
            f"{key}: {idx} is damaged: {size} bytes where its header implies {expected}; "
            f"prepare the data again"
        )
    lengths = np.fromfile(idx, dtype=np.int32, count=n_seq, offset=_IDX_HEADER)
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


def _resolve_split(
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


class _MegatronTokenizer:
    """What megatron-core's GPTDataset needs from a tokenizer (and the cache key it hashes)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.vocab_size = tok.vocab_size
        # Character-level data has no end-of-document id; -2 never occurs in the data.
        self.eod = tok.eod_id if tok.eod_id is not None else -2
        self.pad = -1  # never in the data: no sample is padded (partial sequences are dropped)
        self.unique_identifiers = {"class": "pretrain.Tokenizer", "identifier": tok.identifier}


# ----------------------------------------------------------------------------- datasets


def bin_mappings(ds: Any) -> list[mmap.mmap]:
    """The memory maps of the .bin files behind a megatron-core dataset (GPTDataset or a
    BlendedDataset of them): IndexedDataset.bin_reader._bin_buffer_mmap (a numpy memmap)
    ._mmap, megatron-core 0.16's _MMapBinReader. Empty with megatron's file reader."""
    out, seen, todo = [], set(), [ds]
    while todo:
        d = todo.pop()
        if d is None or id(d) in seen:
            continue
        seen.add(id(d))
        todo.extend(getattr(d, "datasets", None) or [])  # a blend's parts
        todo.append(getattr(d, "dataset", None))  # GPTDataset -> IndexedDataset
        reader = getattr(d, "bin_reader", None)
        memmap = getattr(reader, "_bin_buffer_mmap", None)
        m = getattr(memmap, "_mmap", None)
        if isinstance(m, mmap.mmap):
            out.append(m)
    return out


def advise_random(ds: Any) -> int:
    """madvise(MADV_RANDOM) on every .bin mapping of `ds`: a page fault reads that page only,
    not the kernel's read-ahead window around it. Returns the number of mappings advised."""
    maps = bin_mappings(ds)
    for m in maps:
        m.madvise(mmap.MADV_RANDOM)
    return len(maps)


def read_token_stream(entries: list[str], limit: int, key: str = "data.valid") -> np.ndarray:
    """The first `limit` tokens of `entries`' documents in file order, one stream (int64).

    Length evaluation reads this instead of megatron's samples: a window of 8x the training
    length is then eight consecutive 1x windows of the same text, and a sliding window has
    something to slide over. Shorter than `limit` when the data is."""
    parts: list[np.ndarray] = []
    left = limit
    for i, entry in enumerate(entries):
        for prefix in resolve_entry(entry, "valid", f"{key}[{i}]"):
            if left <= 0:
                break
            with open(f"{prefix.path}.idx", "rb") as f:
                code = struct.unpack("<QBQQ", f.read(_IDX_HEADER)[9:])[1]
            DType = import_quietly("megatron.core.datasets.indexed_dataset").DType
            tokens = np.memmap(f"{prefix.path}.bin", dtype=DType.dtype_from_code(code), mode="r")
            take = min(left, tokens.shape[0])
            parts.append(np.asarray(tokens[:take], dtype=np.int64))
            left -= take
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def document_lengths(
    entries: list[str], key: str = "data.train", limit: int = 2_000_000
) -> np.ndarray:
    """The token counts of the first `limit` documents of `entries` (each ending with its
    end-of-document token), from the .idx files alone: what document masking saves depends
    on them (data/documents.attended_fraction)."""
    Indexed = import_quietly("megatron.core.datasets.indexed_dataset").IndexedDataset
    parts, left = [], limit
    for i, entry in enumerate(entries):
        for prefix in resolve_entry(entry, "train", f"{key}[{i}]"):
            if left <= 0:
                break
            index = Indexed(str(prefix.path), mmap=True)
            # A copy while the mapping is open: the index unmaps when it is collected.
            lengths = np.array(index.sequence_lengths[:left], dtype=np.int64)
            del index
            parts.append(lengths)
            left -= len(lengths)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class TokenDataset(torch.utils.data.Dataset):
    """megatron-core samples as {"input_ids", "labels"}; labels of masked positions are -100.
    With the document switches also "document_ids" and/or "position_ids" (data/documents.py),
    computed from the sample's own tokens, so every reader (resume, rollback windows, any
    number of workers) gets the same ones.

    With read_mode "random" the .bin mappings get MADV_RANDOM in each process that reads
    (a DataLoader worker inherits the advice by fork; a spawned one re-maps, so the advice
    is applied at its first read)."""

    def __init__(
        self,
        inner: torch.utils.data.Dataset,
        seq_len: int,
        prefixes: list[Prefix],
        read_mode: str = "random",
        documents: DocumentSwitches | None = None,
    ) -> None:
        self.inner = inner
        self.documents = documents or DocumentSwitches()
        self.seq_len = seq_len
        self.prefixes = prefixes
        self.read_mode = read_mode
        self._advised_in: int | None = None  # the pid whose mappings were advised
        self._advise()

    def _advise(self) -> None:
        if self.read_mode == "random":
            advise_random(self.inner)
        self._advised_in = os.getpid()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._advised_in != os.getpid():
            self._advise()
        item = self.inner[int(i)]
        tokens = item["tokens"]
        labels = item["labels"].clone()
        labels[item["loss_mask"] == 0] = -100
        labels = self.documents.mask_labels(tokens, labels)
        return {"input_ids": tokens, "labels": labels, **self.documents.model_inputs(tokens)}

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.prefixes)


def _cache_dir(data: DataConfig, first_prefix: str) -> Path:
    return Path(data.cache_dir) if data.cache_dir else Path(first_prefix).parent / "cache"


def _check_cache_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DataError(
            f"data.cache_dir: cannot write megatron's index cache to {path} ({e}); "
            f"set data.cache_dir to a writable folder"
        ) from None


@contextlib.contextmanager
def _single_process_rank() -> Iterator[None]:
    """While megatron-core builds, it sees one process: rank 0, no process group.

    Every rank that calls the builder then builds the index files it misses and loads those
    it finds; megatron's own protocol (rank 0 builds, a barrier, the others load and die of a
    FileNotFoundError on a node that cannot see rank 0's folder) never runs.
    `_build_on_ranks` coordinates the ranks instead. Without a process group this also lets
    megatron-core 0.16.1's BlendedDataset, which calls get_rank() unchecked, blend at all.
    """
    dist = torch.distributed
    original = dist.is_initialized, dist.get_rank
    dist.is_initialized = lambda: False
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.is_initialized, dist.get_rank = original


def _process_group() -> tuple[int, int] | None:
    """(rank, world size) of an initialised process group of more than one process, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _cache_files(datasets, cache: Path) -> list[str]:
    """Names of the index files in `cache` that the built datasets read (megatron names them
    HASH-CLASS-SPLIT-*.npy / description.txt by each dataset's unique_description_hash)."""
    hashes, todo = set(), [d for d in datasets if d is not None]
    while todo:
        ds = todo.pop()
        hashes.add(ds.unique_description_hash)
        todo.extend(getattr(ds, "datasets", None) or [])  # a blend's parts
    return sorted(n for n in os.listdir(cache) if n.split("-", 1)[0] in hashes)


def _missing(cache: Path, names: list[str]) -> list[str]:
    try:
        present = set(os.listdir(cache))
    except OSError:
        present = set()
    return [n for n in names if n not in present]


def _on_every_rank(fn: Callable[[], Any], rank: int, world: int) -> Any:
    """fn() on this rank; when it fails on any rank, every rank raises the same one-line
    DataError (the failing rank keeps its own exception), so that no rank waits forever in a
    collective for a rank that died, nor dies of the closed connection it leaves."""
    try:
        out, error = fn(), None
    except DataError as e:
        out, error, own = None, str(e), e
    except Exception as e:  # anything else: this rank re-raises it with its traceback
        out, error, own = None, f"{type(e).__name__}: {e}", e
    errors: list[str | None] = [None] * world
    torch.distributed.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return out
    if error is not None and not isinstance(own, DataError):
        raise own
    first_rank, first = failed[0]
    if all(e == first for _, e in failed) and len(failed) == world:
        raise DataError(first)
    raise DataError(f"rank {first_rank}: {first}")


def _build_on_ranks(build: Callable[[], Any], cache: Path) -> Any:
    """Build the datasets and megatron's index cache on every rank, the cache only once where
    the ranks share the folder.

    One process: build (writing the cache). Several: rank 0 builds while the others wait; rank
    0 names the cache files; each rank checks that it sees them. Where a rank does not (the
    folder is on a node-local disk), the first process of each node (LOCAL_RANK 0) that lacks
    them builds its node's copy; if a rank still lacks them, every rank stops with one line
    naming data.cache_dir. Then every rank loads. Each step ends in a collective, so an error
    on one rank stops all of them with the same line.
    """
    group = _process_group()
    if group is None:
        _check_cache_writable(cache)
        return build()
    rank, world = group
    local_rank = int(os.environ.get("LOCAL_RANK", rank))

    def build_first():
        _check_cache_writable(cache)
        return build()

    built = _on_every_rank(build_first if rank == 0 else lambda: None, rank, world)
    names = [_cache_files(built, cache) if rank == 0 else None]
    torch.distributed.broadcast_object_list(names, src=0)
    names = names[0]
    missing = _missing(cache, names)
    if missing:  # a file system that shows new files late: look once more
        time.sleep(1.0)
        missing = _missing(cache, names)
    views: list[tuple[str, int, str] | None] = [None] * world
    torch.distributed.all_gather_object(views, (socket.gethostname(), len(missing), str(cache)))
    if any(n for _, n, _ in views):
        lacking = sorted({host for host, n, _ in views if n})
        if rank == 0:
            log.warning(
                "data.cache_dir: %s is not shared by every node (%s cannot see the %d index "
                "files rank 0 wrote); the first process of each such node builds its own "
                "copy. Set data.cache_dir to a folder all nodes share to build it once",
                cache,
                ", ".join(lacking),
                len(names),
            )
        own_copy = local_rank == 0 and bool(missing)

        def build_copy():
            if own_copy:
                _check_cache_writable(cache)
                return build()
            return None

        copy = _on_every_rank(build_copy, rank, world)
        built = built if rank == 0 else copy
        torch.distributed.barrier()
        missing = _missing(cache, names)
        views = [None] * world
        torch.distributed.all_gather_object(views, (socket.gethostname(), len(missing), str(cache)))
        still = [(r, host, folder) for r, (host, n, folder) in enumerate(views) if n]
        if still:
            r, host, folder = still[0]
            raise DataError(
                f"data.cache_dir: rank {r} on {host} cannot see megatron's index cache in {folder}, "
                f"not even after the first process of its node (LOCAL_RANK=0) built a copy; set "
                f"data.cache_dir to a folder that all nodes share, or to a node-local folder that "
                f"all ranks of a node share (and launch with LOCAL_RANK set)"
            )
    # Every rank now sees every file: the others load (rank 0 and the node copies are built).
    return _on_every_rank(lambda: built if built is not None else build(), rank, world)


def build_datasets(
    data: DataConfig, seq_len: int, seed: int, train_samples: int, valid_samples: int
) -> tuple[TokenDataset, TokenDataset | None]:
    """Train and (when data.valid is set) valid datasets of at least the requested samples.

    Call on every rank: with torch.distributed initialised, rank 0 builds the index cache
    first and the others read it; on nodes that cannot see rank 0's cache folder the first
    process of the node builds a copy (see `_build_on_ranks`).
    """
    if train_samples <= 0:
        raise DataError(f"train_samples={train_samples} must be positive")
    tok = tokenizer_for_data(data)
    documents = DocumentSwitches.of(data, tok.eod_id, f"the tokenizer {tok.identifier}")
    train_paths, train_w, train_prefixes = _resolve_split(
        data.train, data.train_weights, "train", "data.train"
    )
    if not train_paths:
        raise DataError("data.train has no entry with a positive weight")
    valid_paths, valid_w, valid_prefixes = ([], [], [])
    if data.valid and valid_samples > 0:
        valid_paths, valid_w, valid_prefixes = _resolve_split(
            data.valid, None, "valid", "data.valid"
        )

    GPTDataset = import_quietly("megatron.core.datasets.gpt_dataset")
    builder_mod = import_quietly("megatron.core.datasets.blended_megatron_dataset_builder")

    def blend(paths: list[str], weights: list[float]):
        if not paths:
            return None
        # One prefix: no blend. Several: explicit weights, which megatron needs with a size.
        return (paths, None) if len(paths) == 1 else (paths, weights)

    cache = _cache_dir(data, train_paths[0])
    config = GPTDataset.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend_per_split=[blend(train_paths, train_w), blend(valid_paths, valid_w), None],
        path_to_cache=str(cache),
        tokenizer=_MegatronTokenizer(tok),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=data.read_mode != "file",
    )
    sizes = [train_samples, valid_samples if valid_paths else None, None]

    def build():
        try:
            with _single_process_rank():
                return builder_mod.BlendedMegatronDatasetBuilder(
                    GPTDataset.GPTDataset, sizes, lambda: True, config
                ).build()
        except (AssertionError, IndexError) as e:  # megatron's own checks; say which data
            raise DataError(
                f"megatron-core could not build samples from data.train/data.valid ({type(e).__name__}: {e})"
            ) from None

    train, valid, _ = _build_on_ranks(build, cache)
    log.info(
        "train: %d samples of %d tokens from %d prefixes (%d tokens)%s",
        len(train),
        seq_len,
        len(train_paths),
        sum(p.tokens for p in train_prefixes),
        f"; valid: {len(valid)} samples from {len(valid_paths)} prefixes"
        if valid is not None
        else "",
    )
    return (
        TokenDataset(train, seq_len, train_prefixes, data.read_mode, documents),
        TokenDataset(valid, seq_len, valid_prefixes, data.read_mode, documents)
        if valid is not None
        else None,
    )


# ----------------------------------------------------------------------------- loading


class GlobalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Micro batches of this rank's slice of each global batch, from `consumed_samples` on.

    Global batch g = samples [c + g*GB, c + (g+1)*GB); rank r takes the contiguous slice
    [r*GB/W, (r+1)*GB/W) of it, cut into micro batches. Stops before a global batch that
    would run past the dataset.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_world: int,
        consumed_samples: int = 0,
    ) -> None:
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        if micro_batch < 1 or global_batch % (micro_batch * dp_world):
            raise ConfigError(
                f"train.global_batch_size={global_batch} must be a multiple of train.micro_batch_size="
                f"{micro_batch} x {dp_world} data-parallel ranks = {micro_batch * dp_world}"
            )
        if consumed_samples < 0:
            raise ConfigError(f"consumed_samples={consumed_samples} must be >= 0")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.per_rank = global_batch // dp_world
        self.rank_offset = dp_rank * self.per_rank
        self.consumed = consumed_samples

    def __len__(self) -> int:
        global_batches = max(0, (self.num_samples - self.consumed) // self.global_batch)
        return global_batches * (self.per_rank // self.micro_batch)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed
        while start + self.global_batch <= self.num_samples:
            first = start + self.rank_offset
            for m in range(0, self.per_rank, self.micro_batch):
                yield list(range(first + m, first + m + self.micro_batch))
            start += self.global_batch


def make_loader(
    ds: torch.utils.data.Dataset,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_world: int,
    consumed_samples: int = 0,
    num_workers: int = 1,
) -> torch.utils.data.DataLoader:
    """Micro batches (dicts of stacked tensors) for this rank; see GlobalBatchSampler for the order."""
    sampler = GlobalBatchSampler(
        len(ds), global_batch, micro_batch, dp_rank, dp_world, consumed_samples
    )
    return torch.utils.data.DataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
        prefetch_factor=4 if num_workers > 0 else None,
    )


__all__ = [
    "DataError",
    "GlobalBatchSampler",
    "TokenDataset",
    "advise_random",
    "bin_mappings",
    "build_datasets",
    "check_prefix",
    "make_loader",
    "tokenizer_for_data",
]
