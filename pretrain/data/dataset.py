"""Training samples from prepared data, through megatron-core's GPTDataset and blending.

    train_ds, valid_ds = build_datasets(cfg.data, seq_len=2048, seed=1234,
                                        train_samples=iters * gbs, valid_samples=n)
    train_ds[i]  # {"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}
    loader = make_loader(train_ds, global_batch=gbs, micro_batch=mbs, dp_rank=r, dp_world=w,
                         consumed_samples=restored_position, num_workers=cfg.data.num_workers)

Each `data.train` / `data.valid` entry is a prepared folder (its shards join the blend with
weights proportional to their tokens) or a megatron-core PREFIX of PREFIX.bin + PREFIX.idx;
pretrain/data/prefixes.py resolves and checks them and finds their tokenizer.
Entries are blended by `data.train_weights` (or by their token counts). Samples are seq_len+1
consecutive tokens of the shuffled document stream, crossing document boundaries (megatron's
GPTDataset); the order is fixed by the seed, and megatron caches it beside the data
(pretrain/data/index_cache.py coordinates building it across ranks and nodes).

The loader's order: global batch g holds samples [c + g*GB, c + (g+1)*GB) where c is
`consumed_samples`; rank r reads only its contiguous slice of GB/world samples, in micro
batches. The same samples are trained on whatever the number of ranks, and a run resumed
at c continues exactly where it stopped.

Besides megatron's samples, the entries' tokens in file order (`read_token_stream`, for length
evaluation) and their documents' lengths (`document_lengths`, for the planner's document
masking figures), read from the files directly.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pretrain.config import ConfigError, DataConfig
from pretrain.data.documents import DocumentSwitches
from pretrain.data.index_cache import build_on_ranks, index_cache_dir, single_process_rank
from pretrain.data.megatron_compat import import_quietly
from pretrain.data.prefixes import (
    IDX_HEADER,
    DataError,
    Prefix,
    resolve_entry,
    resolve_split,
    tokenizer_for_data,
)
from pretrain.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
                code = struct.unpack("<QBQQ", f.read(IDX_HEADER)[9:])[1]
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


def build_datasets(
    data: DataConfig, seq_len: int, seed: int, train_samples: int, valid_samples: int
) -> tuple[TokenDataset, TokenDataset | None]:
    """Train and (when data.valid is set) valid datasets of at least the requested samples.

    Call on every rank: with torch.distributed initialised, rank 0 builds the index cache
    first and the others read it; on nodes that cannot see rank 0's cache folder the first
    process of the node builds a copy (see index_cache.build_on_ranks).
    """
    if train_samples <= 0:
        raise DataError(f"train_samples={train_samples} must be positive")
    tok = tokenizer_for_data(data)
    documents = DocumentSwitches.of(data, tok.eod_id, f"the tokenizer {tok.identifier}")
    train_paths, train_w, train_prefixes = resolve_split(
        data.train, data.train_weights, "train", "data.train"
    )
    if not train_paths:
        raise DataError("data.train has no entry with a positive weight")
    valid_paths, valid_w, valid_prefixes = ([], [], [])
    if data.valid and valid_samples > 0:
        valid_paths, valid_w, valid_prefixes = resolve_split(
            data.valid, None, "valid", "data.valid"
        )

    GPTDataset = import_quietly("megatron.core.datasets.gpt_dataset")
    builder_mod = import_quietly("megatron.core.datasets.blended_megatron_dataset_builder")

    def blend(paths: list[str], weights: list[float]):
        if not paths:
            return None
        # One prefix: no blend. Several: explicit weights, which megatron needs with a size.
        return (paths, None) if len(paths) == 1 else (paths, weights)

    cache = index_cache_dir(data, train_paths[0])
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
            with single_process_rank():
                return builder_mod.BlendedMegatronDatasetBuilder(
                    GPTDataset.GPTDataset, sizes, lambda: True, config
                ).build()
        except (AssertionError, IndexError) as e:  # megatron's own checks; say which data
            raise DataError(
                f"megatron-core could not build samples from data.train/data.valid ({type(e).__name__}: {e})"
            ) from None

    train, valid, _ = build_on_ranks(build, cache)
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
