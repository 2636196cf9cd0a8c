"""The cost of in-loop downstream evaluation (downstream.*) in a run's plan.

Forward FLOPs of the requests: tokens forwarded per document (measured with the GPT-NeoX
tokenizer on the local task data, every document, after the adapter's sharing of inputs
between requests that differ only in their last token) x 2 x the matmul weights, plus
attention at the requests' length. Each evaluation scores `examples` documents per task;
a run evaluates every `interval` steps and at the end. The share is of the run's executed
training FLOPs; its time is that share of the run's time at the same MFU (evaluation
batches are smaller than training's, so the time is a lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.config import Config
from pretrain.model.transformer import Transformer

# Tokens forwarded per document, and the longest request (GPT-NeoX tokenizer, all documents
# of ../shared/data/evals; the model's context caps them).
TOKENS_PER_DOCUMENT: dict[str, tuple[float, int]] = {
    "arc_challenge": (136.3, 133),
    "arc_easy": (111.0, 108),
    "lambada_openai": (80.2, 223),
    "lambada_standard": (80.2, 223),  # the same passages as lambada_openai
    "logiqa": (839.6, 499),
    "piqa": (70.7, 241),
    "pubmedqa": (315.2, 633),
    "sciq": (305.3, 583),
    "winogrande": (43.0, 38),
    "wsc273": (41.2, 45),
}
PAPER_TASKS = tuple(TOKENS_PER_DOCUMENT)
DOCUMENTS = {  # documents per task in the local data (the examples drawn are at most these)
    "arc_challenge": 299,
    "arc_easy": 570,
    "lambada_openai": 5153,
    "lambada_standard": 5153,
    "logiqa": 651,
    "piqa": 1838,
    "pubmedqa": 500,
    "sciq": 1000,
    "winogrande": 1267,
    "wsc273": 273,
}


@dataclass(frozen=True)
class DownstreamCost:
    evaluations: int
    flops_per_evaluation: float
    flops: float  # all evaluations of the run
    share: float  # of the run's executed training FLOPs
    seconds: float  # that share of the run's time
    unplanned: tuple[str, ...] = ()  # tasks outside TOKENS_PER_DOCUMENT: not counted


def downstream_cost(
    cfg: Config, train_flops: float, run_seconds: float, n_matmul: float | None = None
) -> DownstreamCost | None:
    """The cost of `cfg.downstream` in a run of `train_flops` executed FLOPs taking
    `run_seconds`; `n_matmul`: the model's matmul weights (lm_head included; default: the
    model's own count, `Transformer.matmul_params`). None when the run evaluates no task. A
    harness task this module has no measurement of is left out and named in `unplanned`."""
    d = cfg.downstream
    if not d.tasks:
        return None
    tasks = [t for name in d.tasks for t in (PAPER_TASKS if name == "paper" else (name,))]
    m = cfg.model
    if n_matmul is None:
        with torch.device("meta"):
            n_matmul = float(Transformer(m).matmul_params())
    flops = 0.0
    unplanned = tuple(t for t in dict.fromkeys(tasks) if t not in TOKENS_PER_DOCUMENT)
    for task in dict.fromkeys(tasks):
        if task in unplanned:
            continue
        tokens, longest = TOKENS_PER_DOCUMENT[task]
        length = min(longest, m.max_seq_len)
        attention = 4 * m.n_layers * m.n_heads * m.head_dim * length  # QK^T and AV, forward
        flops += min(d.examples, DOCUMENTS[task]) * tokens * (2 * n_matmul + attention)
    iters = cfg.train.train_iters
    evaluations = (iters // d.interval if d.interval else 0) + bool(
        not d.interval or iters % d.interval
    )
    total = flops * evaluations
    share = total / train_flops
    return DownstreamCost(evaluations, flops, total, share, share * run_seconds, unplanned)
