"""The `data:` section (what a run trains on, how samples are read, packed documents), and the
checks of its paths and vocabulary on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pretrain.schema import Bool, ConfigError, Float, Hint, Int, Section


class DataConfig(Section):
    """What to train on: prepared indexed datasets (tools/prepare_data.py or Megatron/NeoX)."""

    key = "data"

    train: list[str] = Field(default_factory=list)
    """prepared datasets: folders written by `tools/prepare_data.py` or megatron-core prefixes (PREFIX.bin + PREFIX.idx)"""
    train_weights: Annotated[
        list[Annotated[Float, Field(ge=0)]] | None,
        Hint("blend weights: non-negative, with a positive sum"),
    ] = None
    """blend weights, one per `train` entry; null = proportional to their tokens"""
    valid: list[str] = Field(default_factory=list)
    """validation datasets; empty = no validation"""
    tokenizer: str | None = None
    """tokenizer spec; null = the one recorded with the first train dataset"""
    cache_dir: str | None = None
    """where megatron-core caches sample indices; null = beside the data"""
    num_workers: Int = Field(1, ge=0)
    """DataLoader workers per rank"""
    read_mode: Literal["random", "readahead", "file"] = "random"
    """how the .bin files are read: `random` (a memory map with `madvise(MADV_RANDOM)`: a sample reads its pages, not a read-ahead window; docs/speed.md), `readahead` (a plain memory map: the kernel reads ahead), `file` (megatron-core's file reader)"""
    recipe: Literal["stdlib"] | None = None
    """`stdlib`: build `train[0]` from the installed Python standard library when it is missing (the quickstart)"""
    document_mask: Bool = False
    """no token attends across an end-of-document token of a packed sample (docs/document_masking.md)"""
    position_reset: Bool = False
    """positions (RoPE, learned) restart at 0 after each end-of-document token"""
    eod_mask_loss: Bool = False
    """the token after an end-of-document token (the next document's first) is not a training target"""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        w = self.train_weights
        if w is None or not self.train:
            return self
        if len(w) != len(self.train):
            raise ConfigError(
                f"data.train_weights has {len(w)} entries but data.train has "
                f"{len(self.train)}; give one weight per dataset"
            )
        if sum(w) <= 0:
            raise ConfigError(
                f"data.train_weights={list(w)} must be non-negative with a positive sum"
            )
        return self


# What needs this machine: the preflight (pretrain/preflight.py) and the data pipeline call
# these at start, never a study on the machine that plans it.


def check_data_paths(data: DataConfig) -> None:
    """Every dataset of `data.train` and `data.valid` is on this machine."""
    for key, paths in (("data.train", data.train), ("data.valid", data.valid)):
        for i, path in enumerate(paths):
            prefix = all(Path(path + x).is_file() for x in (".bin", ".idx"))
            if not (Path(path).is_dir() or prefix):
                raise ConfigError(
                    f"{key}[{i}]={path!r} not found: give a folder written by "
                    f"tools/prepare_data.py or a megatron-core prefix with PREFIX.bin and PREFIX.idx"
                )


def check_vocab(vocab_size: int, tokenizer_vocab_size: int) -> None:
    """The model's vocabulary must hold every id the tokenizer of the data can produce."""
    if tokenizer_vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab_size}); set model.vocab_size={tokenizer_vocab_size}"
        )
