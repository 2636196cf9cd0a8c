"""Loss by position in the window, at the training length and past it.

Position p (0-based) is the loss of predicting token p + 1 of a window from its first p + 1
tokens: the curve shows what more context buys, and, past the training length, where a
position encoding stops generalising. Per-token losses come from the chunked loss
(`model.loss.token_losses`): one forward per window, never the whole logits.

Two sources of windows:
- the validation samples of `--val` (megatron's shuffled samples at the training length):
  `evaluate_loss(..., positions=PositionLosses(seq_len))` fills the curve in the same pass
  that computes valid/loss, so the two agree by construction;
- the validation documents in file order as one token stream (`--lengths`): every length
  scores the same first N targets of that stream (N a multiple of the longest length), as
  disjoint windows or sliding ones (`stride` < length: each window after the first scores
  only its last `stride` targets, the ones no earlier window scored, with length - stride
  tokens of context before them). Stride = length is the disjoint windows exactly.

Buckets: every position below 256, then four per octave (256, 304, 362, 431, 512, ...);
the in-training scalars use coarser ranges (`position_ranges`). Plots of the buckets:
pretrain/eval/position_plots.py.
On several ranks, windows are dealt round-robin and the sums all-reduced: every rank gets
the same result as one rank would.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.data.documents import DocumentSwitches
from pretrain.eval.position_plots import plot_positions
from pretrain.model.loss import IGNORE_INDEX, token_losses
from pretrain.run_layout import atomic_write
from pretrain.tables import pipe_table

EVERY_POSITION_BELOW = 256
BUCKETS_PER_OCTAVE = 4
POSITIONS_JSON = "positions.json"
POSITIONS_CSV = "positions.csv"
POSITIONS_PNG = "positions.png"


def bucket_edges(length: int) -> list[int]:
    """[0, 1, ..., 256, 304, 362, ..., length]: bucket i is [edges[i], edges[i + 1])."""
    edges = list(range(min(length, EVERY_POSITION_BELOW) + 1))
    k = 1
    while edges[-1] < length:
        nxt = round(EVERY_POSITION_BELOW * 2 ** (k / BUCKETS_PER_OCTAVE))
        edges.append(min(nxt, length))
        k += 1
    return edges


def position_ranges(seq_len: int) -> list[tuple[int, int]]:
    """[0, 16), [16, 256), then octaves [256, 512), ... up to seq_len."""
    edges = [0, 16, 256]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 2)
    edges = sorted({min(e, seq_len) for e in edges})
    return list(zip(edges, edges[1:], strict=False))


@dataclass
class PositionLosses:
    """Sums of per-token losses and target counts at each position of a window (fp64)."""

    length: int
    sums: torch.Tensor = field(init=False)
    counts: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.sums = torch.zeros(self.length, dtype=torch.float64)
        self.counts = torch.zeros(self.length, dtype=torch.float64)

    def add(self, losses: torch.Tensor, labels: torch.Tensor) -> None:
        """losses (B, T) from `token_losses`, labels (B, T); T <= length."""
        keep = labels != IGNORE_INDEX
        T = losses.shape[1]
        if self.sums.device != losses.device:
            self.sums, self.counts = self.sums.to(losses.device), self.counts.to(losses.device)
        self.sums[:T] += torch.where(keep, losses.double(), 0.0).sum(0)
        self.counts[:T] += keep.sum(0).double()

    def all_reduce(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            both = torch.stack([self.sums, self.counts])
            torch.distributed.all_reduce(both)
            self.sums, self.counts = both[0].clone(), both[1].clone()

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())

    @property
    def loss(self) -> float:
        return float(self.sums.sum() / self.counts.sum())

    def buckets(self) -> tuple[Bucket, ...]:
        sums, counts = self.sums.cpu(), self.counts.cpu()
        out = []
        edges = bucket_edges(self.length)
        for a, b in zip(edges, edges[1:], strict=False):
            n = float(counts[a:b].sum())
            if n:
                out.append(Bucket(a, b, float(sums[a:b].sum()) / n, int(n)))
        return tuple(out)


@dataclass(frozen=True)
class Bucket:
    """Positions [start, end) of a window: their mean loss over `tokens` targets."""

    start: int
    end: int
    loss: float
    tokens: int


def merge_buckets(buckets: Iterable[Bucket]) -> Bucket:
    """Adjacent buckets as one, its loss the token-weighted mean: the exact loss over all
    their positions (NaN for no tokens)."""
    members = list(buckets)
    tokens = sum(b.tokens for b in members)
    loss = sum(b.loss * b.tokens for b in members) / tokens if tokens else math.nan
    return Bucket(members[0].start, members[-1].end, loss, tokens)


@dataclass(frozen=True)
class LengthResult:
    """One length's figures, as positions.json holds them (written here, read back by
    compare_positions.parse_positions)."""

    length: int
    stride: int
    windows: int
    loss: float
    tokens: int
    buckets: tuple[Bucket, ...]

    @classmethod
    def of(cls, stats: PositionLosses, stride: int, windows: int) -> LengthResult:
        return cls(stats.length, stride, windows, stats.loss, stats.tokens, stats.buckets())


@torch.no_grad()
def score_tokens(
    model: Any, input_ids: torch.Tensor, labels: torch.Tensor, **documents: torch.Tensor
) -> torch.Tensor:
    """Per-token losses (B, T), fp32, 0 where labels are ignored: one forward of `model` (a
    Transformer or a DeepSpeed engine around one); `documents`: document_ids, position_ids."""
    module = getattr(model, "module", model)
    hidden = module.hidden_states(input_ids, **documents)
    return token_losses(hidden, module.lm_head.weight, labels)


# ----------------------------------------------------------------------------- windows


def stream_windows(n_targets: int, length: int, stride: int) -> list[tuple[int, int]]:
    """(begin, first scored position) of each window over the first `n_targets` targets."""
    if not 0 < stride <= length:
        raise ValueError(f"stride {stride} must be in [1, window length {length}]")
    out = [(0, 0)]
    begin = stride
    while begin + length <= n_targets:
        out.append((begin, length - stride))
        begin += stride
    return out


def _batches(
    stream: np.ndarray, windows: list[tuple[int, int]], length: int, batch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(0, len(windows), batch):
        part = windows[i : i + batch]
        rows = np.stack([stream[b : b + length + 1] for b, _ in part])
        x = torch.from_numpy(rows[:, :-1].copy())
        y = torch.from_numpy(rows[:, 1:].copy())
        for j, (_, first) in enumerate(part):
            y[j, :first] = IGNORE_INDEX
        yield x, y


def evaluate_length(
    model: Any,
    stream: np.ndarray,
    length: int,
    stride: int | None = None,
    n_targets: int | None = None,
    batch_tokens: int = 16384,
    device: torch.device | str | None = None,
    progress: bool = False,
    documents: DocumentSwitches | None = None,
) -> LengthResult:
    """Loss by position of `model` over windows of `length` tokens of `stream` (see the
    module docstring); on several ranks each scores its share of the windows. `documents`:
    the run's document switches, applied to each window as training applied them."""
    documents = documents or DocumentSwitches()
    module = getattr(model, "module", model)
    if device is None:
        device = next(module.parameters()).device
    stride = stride or length
    n_targets = n_targets if n_targets is not None else len(stream) - 1
    if n_targets < length or len(stream) < length + 1:
        raise ValueError(
            f"the validation stream holds {len(stream)} tokens: too few for one window of "
            f"{length}; use more validation data or shorter --lengths"
        )
    windows = stream_windows(n_targets, length, stride)
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = windows[rank::world]
    stats = PositionLosses(length)
    batch = max(1, batch_tokens // length)
    was_training = getattr(module, "training", False)
    module.eval()
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(mine), desc=f"length {length}", unit="window", leave=False)
    try:
        for x, y in _batches(stream, mine, length, batch):
            x, y = x.to(device), y.to(device)
            y = documents.mask_labels(x, y)
            stats.add(score_tokens(model, x, y, **documents.model_inputs(x)), y)
            if bar is not None:
                bar.update(x.shape[0])
    finally:
        if bar is not None:
            bar.close()
        module.train(was_training)
    stats.all_reduce()
    return LengthResult.of(stats, stride, len(windows))


def common_targets(stream_tokens: int, lengths: list[int], budget: int) -> int:
    """Targets every length scores: at most `budget`, a multiple of the longest length (so
    each length's disjoint windows cover the same tokens)."""
    longest = max(lengths)
    n = (min(budget, stream_tokens - 1) // longest) * longest
    if n == 0:
        raise ValueError(
            f"the validation stream holds {stream_tokens} tokens: too few for one window of "
            f"the longest length {longest}; use more validation data (--val-data), a larger "
            f"--val-samples, or shorter --lengths"
        )
    return n


# ----------------------------------------------------------------------------- files


def positions_record(
    results: list[LengthResult],
    *,
    label: str,
    train_seq_len: int,
    rope_scaling: dict[str, Any] | None,
    source: str,
) -> dict[str, Any]:
    return {
        "label": label,
        "train_seq_len": train_seq_len,
        "rope_scaling": rope_scaling,
        "source": source,
        "results": [asdict(r) for r in results],
    }


def positions_csv(record: dict[str, Any]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["length", "stride", "start", "end", "loss", "tokens"])
    for r in record["results"]:
        for b in r["buckets"]:
            w.writerow(
                [r["length"], r["stride"], b["start"], b["end"], f"{b['loss']:.6f}", b["tokens"]]
            )
    return out.getvalue()


def positions_table(record: dict[str, Any]) -> str:
    """Markdown: loss at each length, and at a few positions of each window."""
    train = record["train_seq_len"]
    header = ["length", "stride", "windows", "tokens", "loss", "first 16", "16-256", "last quarter"]
    rows = []

    def span(r: dict[str, Any], a: int, b: int) -> str:
        sel = [Bucket(**x) for x in r["buckets"] if x["start"] >= a and x["end"] <= b]
        merged = merge_buckets(sel) if sel else None
        return f"{merged.loss:.4f}" if merged and merged.tokens else "–"

    for r in record["results"]:
        L = r["length"]
        ratio = L / train
        name = f"{L} ({ratio:g}x)" if ratio == int(ratio) or ratio > 1 else str(L)
        rows.append(
            [
                name,
                str(r["stride"]),
                str(r["windows"]),
                str(r["tokens"]),
                f"{r['loss']:.4f}",
                span(r, 0, 16),
                span(r, 16, 256),
                span(r, 3 * L // 4, L),
            ]
        )
    return pipe_table(header, rows)


def write_positions(record: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / POSITIONS_JSON, out_dir / POSITIONS_CSV]
    atomic_write(files[0], json.dumps(record, indent=1) + "\n")
    atomic_write(files[1], positions_csv(record))
    files.append(plot_positions(record, out_dir / POSITIONS_PNG))
    return files
