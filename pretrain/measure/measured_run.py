"""A training run made for measuring: `measurement_config`, a config made into a measured
run (its steps and batch, no evaluation, no data files, nothing resumed, loaded or written
but every step's metrics), the recipe of `tools/benchmark.py train`
(pretrain/benchmarks/train.py) and of the GPU check's training stages
(pretrain/gpucheck/training.py); and `RandomTokens`, the batches those runs and
`tools/benchmark.py checkpoint` train on (speed and memory do not depend on the text, so
no data needs preparing).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from pretrain.config import Config, from_dict


class RandomTokens(torch.utils.data.Dataset):
    """`n` sequences of `seq_len` uniformly random token ids below `vocab`, as the data
    pipeline's items (inputs and next-token labels); item i is the same on every call."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
        return {"input_ids": x[:-1], "labels": x[1:]}


def measurement_config(
    data: dict[str, Any],
    run_dir: str,
    steps: int,
    micro_batch: int,
    global_batch: int,
    **train: Any,
) -> Config:
    """A config (as `to_dict` gives it) made into a measured run: `steps` optimizer steps of
    `global_batch` sequences in micro batches of `micro_batch`, `train` fields set as given,
    a 1-step warm-up of the LR, no data files (the caller gives random tokens), nothing
    evaluated, resumed, loaded or written but the metrics of every step. The one recipe of
    `tools/benchmark.py train` and the GPU check's training stages."""
    data = copy.deepcopy(data)
    data["train"].update(
        train_iters=steps,
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        eval_interval=0,
        **train,
    )
    data["data"] = {**data["data"], "train": [], "valid": []}
    data["schedule"] = {**data["schedule"], "warmup_steps": 1, "warmup_fraction": None}
    data["checkpoint"] = {**data["checkpoint"], "resume": False, "init_from": None}
    data["logging"] = {
        **data["logging"],
        "run_dir": run_dir,
        "tensorboard": False,
        "log_interval": 1,
        "max_logit_interval": 0,
        "sample_prompts": [],
    }
    return from_dict(Config, data)
