"""A checkpoint's loss on its validation data: the validation split's loss, perplexity and bits
per token/byte (`evaluate_validation`, with the loss at each position from the same pass), and
loss by position at each evaluated length of the validation stream (`evaluate_lengths`, the
lengths and RoPE scaling of pretrain/eval/lengths.py). pretrain/eval/checkpoint_eval.py runs
them for tools/evaluate.py's --val and --lengths.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError, DataConfig, RopeScalingConfig, from_dict, to_dict
from pretrain.data.dataset import build_datasets, read_token_stream
from pretrain.data.documents import DocumentSwitches
from pretrain.data.prefixes import DataError
from pretrain.eval.lengths import (
    LengthError,
    check_lengths,
    parse_lengths,
    parse_rope_scaling,
    train_length,
    valid_entries,
)
from pretrain.eval.metrics import bytes_per_token, evaluate_loss
from pretrain.eval.positions import (
    LengthResult,
    PositionLosses,
    common_targets,
    evaluate_length,
    positions_record,
)
from pretrain.eval.suite import EvalError
from pretrain.run_layout import CONFIG_FILE

log = logging.getLogger(__name__)


def evaluate_validation(
    weights_dir: Path,
    *,
    valid_data: list[str] | None = None,
    samples: int = 256,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str = "auto",
    per_position: bool = False,
    rope_scaling: RopeScalingConfig | None = None,
) -> tuple[dict[str, float], PositionLosses | None]:
    """Validation loss and bits per token/byte of the run's validation split (or `valid_data`),
    and with `per_position` the loss at each position of those samples, from the same pass."""
    import torch

    from pretrain.eval.harness import load_checkpoint

    model, tok, _, config = load_checkpoint(weights_dir, device=device, dtype=dtype)
    if rope_scaling is not None:
        model.set_rope_scaling(rope_scaling)
    data = from_dict(DataConfig, config.get("data"), "data")
    if valid_data:
        # The builder also wants a train split; the given data serves as both.
        data.valid = list(valid_data)
        data.train, data.train_weights = list(valid_data), None
    if not data.valid:
        raise EvalError(
            f"{weights_dir / CONFIG_FILE} has no data.valid; pass --val-data PREFIX_OR_FOLDER"
        )
    train_cfg = config.get("train") or {}
    seq_len = train_cfg.get("seq_len") or model.cfg.max_seq_len
    _, valid = build_datasets(data, seq_len, train_cfg.get("seed", 1234), 1, samples)
    if valid is None or len(valid) == 0:
        raise EvalError(f"the validation split {data.valid} holds no samples of {seq_len} tokens")
    n = min(samples, len(valid))
    items = [valid[i] for i in range(n)]
    unit = "char" if tok.kind == "chars" else "byte"
    ratio = bytes_per_token(tok, [it["input_ids"] for it in items], unit=unit)
    batches = (
        {
            k: torch.stack([it[k] for it in items[i : i + batch_size]])
            for k in items[0]  # tokens, labels and the document inputs training had
        }
        for i in range(0, n, batch_size)
    )
    positions = PositionLosses(seq_len) if per_position else None
    try:
        out = evaluate_loss(
            model,
            batches,
            positions=positions,
            **({"chars_per_token": ratio} if unit == "char" else {"bytes_per_token": ratio}),
        )
    except ValueError as e:  # e.g. a split too small to hold one scored token
        raise EvalError(
            f"validation data {data.valid}: {e}; prepare a larger validation split "
            f"(tools/prepare_data.py --valid-fraction) or pass --val-data"
        ) from None
    out[f"{unit}s_per_token"] = ratio
    out["samples"] = n
    out["seq_len"] = seq_len
    return out, positions


def evaluate_lengths(
    weights_dir: Path,
    *,
    lengths: str,
    stride: int | None = None,
    rope_scaling: str | RopeScalingConfig | None = None,
    valid_data: list[str] | None = None,
    samples: int = 256,
    batch_tokens: int = 16384,
    device: str | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """positions.json's record: loss by position at each of `lengths` on the validation stream.

    Every length scores the same first N targets of the stream, N = samples x the training
    length rounded down to a multiple of the longest length."""
    from pretrain.eval.harness import load_checkpoint

    model, tok, _, config = load_checkpoint(weights_dir, device=device, dtype=dtype)
    documents = DocumentSwitches.of(
        from_dict(DataConfig, config.get("data"), "data"), tok.eod_id, f"{weights_dir}'s tokenizer"
    )
    train_len = train_length(config, model.cfg.max_seq_len)
    sizes = parse_lengths(lengths, train_len)
    check_lengths(model, sizes)
    if stride is not None:
        if stride < 1:
            raise LengthError(f"--stride {stride} must be a positive number of tokens")
        if stride > min(sizes):
            raise LengthError(
                f"--stride {stride} is longer than the shortest window ({min(sizes)} tokens); "
                f"use a stride of at most {min(sizes)}"
            )
    scaling = rope_scaling
    if isinstance(scaling, str):
        scaling = parse_rope_scaling(scaling)
    if scaling is not None:
        try:
            model.set_rope_scaling(scaling)
        except ConfigError as e:
            raise LengthError(f"--rope-scaling: {e}") from None
    entries = valid_entries(config, valid_data, weights_dir)
    budget = samples * train_len
    try:
        stream = read_token_stream(entries, budget + 1)
        n_targets = common_targets(len(stream), sizes, budget)
    except DataError:  # a ValueError too, but its own message already names file and fix
        raise
    except ValueError as e:
        raise LengthError(str(e)) from None
    results: list[LengthResult] = []
    for L in sizes:
        log.info("length %d: %d targets, stride %s", L, n_targets, stride or L)
        results.append(
            evaluate_length(
                model,
                stream,
                L,
                stride,
                n_targets,
                batch_tokens=batch_tokens,
                progress=True,
                documents=documents,
            )
        )
    return positions_record(
        results,
        label="",
        train_seq_len=train_len,
        rope_scaling=to_dict(model.cfg.rope_scaling),
        source="validation stream",
    )
