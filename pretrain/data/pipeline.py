"""What training asks of the data side, in one call: `build_data(cfg, env)` returns the train
and validation loaders' source and the tokenizer. It builds the quickstart's corpus when a
recipe asks for it, builds megatron-core's datasets (blends, split, resumable order) and
checks the tokenizer against the model's vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pretrain.config import Config
from pretrain.data import dataset
from pretrain.data.config import check_data_paths, check_vocab
from pretrain.data.prefixes import tokenizer_for_data
from pretrain.data.recipes import prepare_stdlib_corpus


class RankInfo(Protocol):
    """This process's place in the job (pretrain.train.distributed.DistEnv is one)."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


@dataclass
class DataSource:
    """Datasets, a loader factory and the tokenizer. Tests and the throughput benchmark give
    in-memory datasets; `make_loader(ds, global_batch, micro_batch, rank, world, consumed,
    workers)` yields {"input_ids", "labels"} micro batches of this rank, in order."""

    train: torch.utils.data.Dataset
    valid: torch.utils.data.Dataset | None
    make_loader: Callable[..., Any]
    tokenizer: Any = None

    def train_batches(self, cfg: Config, env: RankInfo, consumed: int) -> Iterator:
        """This rank's micro batches from sample `consumed` on (a resume neither repeats nor
        skips data)."""
        t = cfg.train
        return iter(
            self.make_loader(
                self.train,
                t.global_batch_size,
                t.micro_batch_size,
                env.rank,
                env.world_size,
                consumed,
                cfg.data.num_workers,
            )
        )

    def valid_batches(self, cfg: Config, env: RankInfo, n: int) -> list:
        """The first `n` validation micro batches of this rank: the same ones every time."""
        t = cfg.train
        loader = iter(
            self.make_loader(
                self.valid, t.global_batch_size, t.micro_batch_size, env.rank, env.world_size, 0, 0
            )
        )
        out = []
        for batch in loader:
            if len(out) == n:
                break
            out.append(batch)
        return out


def prepare_recipe_data(cfg: Config, env: RankInfo) -> None:
    """Build data.train[0] with `data.recipe` (rank 0; the others wait).

    The recipe is idempotent: it returns at once when the folder is complete and finishes
    one that a killed run left half-made.
    """
    if cfg.data.recipe is None:
        return
    target = Path(cfg.data.train[0])
    if env.is_main:
        if not target.exists():
            print(f"preparing the {cfg.data.recipe!r} corpus in {target} (once)", flush=True)
        prepare_stdlib_corpus(target)
    _barrier()


def build_data(cfg: Config, env: RankInfo, valid_samples: int) -> DataSource:
    """megatron-core indexed datasets through pretrain.data.dataset, and their tokenizer."""

    if cfg.data.recipe is not None:  # the preflight checked the paths of prepared data
        prepare_recipe_data(cfg, env)
        check_data_paths(cfg.data)
    t = cfg.train
    if env.is_main:
        print(
            f"building datasets (train {t.train_iters * t.global_batch_size:,} samples "
            f"of {cfg.seq_len} tokens)",
            flush=True,
        )
    train, valid = dataset.build_datasets(
        cfg.data, cfg.seq_len, t.seed, t.train_iters * t.global_batch_size, valid_samples
    )
    tokenizer = tokenizer_for_data(cfg.data)
    check_vocab(cfg.model.vocab_size, tokenizer.vocab_size)
    return DataSource(train, valid, dataset.make_loader, tokenizer)
