"""Validation loss, perplexity, bits per token and bits per byte (or per character).

One function, `evaluate_loss`, serves training (at eval intervals) and `tools/evaluate.py
--val`. It averages the cross-entropy over every target token of every batch (not the mean
of per-batch means, which would weight a short last batch like a full one), in float64, and
sums across data-parallel ranks when torch.distributed is initialised, so every rank gets
the same numbers.

Bits per byte makes models with different tokenizers comparable:
    bits_per_byte = loss_per_token / ln 2 / (bytes per token)
where bytes per token is measured on the same validation text (`bytes_per_token`). For a
character-level model one token is one character, so bits per character = bits per token;
for a byte-level model bits per byte = bits per token.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from pretrain.data.documents import model_inputs_of
from pretrain.eval.positions import PositionLosses, score_tokens
from pretrain.model.loss import IGNORE_INDEX

LN2 = math.log(2.0)


@torch.no_grad()
def evaluate_loss(
    model: Callable[..., torch.Tensor],
    batches: Iterable[Mapping[str, torch.Tensor]],
    bytes_per_token: float | None = None,
    chars_per_token: float | None = None,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    positions: PositionLosses | None = None,
) -> dict[str, float]:
    """Mean next-token loss over `batches` and the figures derived from it.

    model: `Transformer` (or a DeepSpeed engine wrapping one): `model(input_ids, targets)`
        returns the mean cross-entropy over targets != -100.
    batches: dicts with "input_ids" and "labels" (labels = next tokens, -100 = ignore).
    bytes_per_token / chars_per_token: text units per token of this validation data (see
        `bytes_per_token`), to report bits per byte / per character.
    max_batches: stop after this many batches (training's eval_iters).
    positions: when given, also filled with the loss at each position, from the same
        forward (per-token losses of the chunked loss), all-reduced like the mean.

    Returns {"loss", "ppl", "bits_per_token", "tokens"} plus "bits_per_byte" and/or
    "bits_per_char" when their ratio is given. The model's train/eval mode is restored.
    """
    module = getattr(model, "module", model)  # DeepSpeed engine -> the model
    was_training = getattr(module, "training", False)
    if hasattr(module, "eval"):
        module.eval()
    if device is None:
        device = next(module.parameters()).device
    nll = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            documents = model_inputs_of(batch, device)  # what training gave the model
            n = (labels != IGNORE_INDEX).sum()
            if int(n) == 0:
                continue
            if positions is not None:
                losses = score_tokens(model, input_ids, labels, **documents)
                positions.add(losses, labels)
                nll += losses.double().sum()
            else:
                loss = model(input_ids, labels, **documents).loss
                # The model's loss is a mean over this batch's targets; weight it by its count.
                nll += loss.double() * n
            count += n
    finally:
        if was_training and hasattr(module, "train"):
            module.train()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        both = torch.stack([nll, count])
        torch.distributed.all_reduce(both)
        nll, count = both[0], both[1]
        if positions is not None:
            positions.all_reduce()
    tokens = float(count)
    if tokens == 0:
        raise ValueError(
            "evaluate_loss: the batches held no target tokens (all labels are -100 "
            "or the iterable was empty); check the validation data"
        )
    return loss_metrics(float(nll) / tokens, tokens, bytes_per_token, chars_per_token)


def loss_metrics(
    loss: float,
    tokens: float = float("nan"),
    bytes_per_token: float | None = None,
    chars_per_token: float | None = None,
) -> dict[str, float]:
    """The derived figures of a mean loss in nats per token."""
    out = {
        "loss": loss,
        "ppl": math.exp(loss) if loss < 700 else float("inf"),
        "bits_per_token": loss / LN2,
        "tokens": tokens,
    }
    if bytes_per_token:
        out["bits_per_byte"] = loss / LN2 / bytes_per_token
    if chars_per_token:
        out["bits_per_char"] = loss / LN2 / chars_per_token
    return out


def bytes_per_token(
    tokenizer: Any, sequences: Iterable[Sequence[int]], unit: str = "byte"
) -> float:
    """UTF-8 bytes (unit="byte") or characters (unit="char") per token of token sequences.

    `sequences` are token ids as the model sees them (e.g. `ds[i]["input_ids"]` of the
    validation set); each is decoded with the tokenizer and measured. End-of-document
    tokens count as tokens (the loss predicts them) but add no text. A sequence cut inside
    a multi-byte character decodes that piece as U+FFFD; over a validation set of whole
    samples this moves the ratio by a few parts per million.
    """
    if unit not in ("byte", "char"):
        raise ValueError(f"unit={unit!r}: use 'byte' or 'char'")
    n_units = n_tokens = 0
    eod = getattr(tokenizer, "eod_id", None)
    for seq in sequences:
        ids = seq.tolist() if hasattr(seq, "tolist") else list(seq)
        text = tokenizer.decode([i for i in ids if i != eod])
        n_units += len(text.encode("utf-8")) if unit == "byte" else len(text)
        n_tokens += len(ids)
    if n_tokens == 0:
        raise ValueError("bytes_per_token: no tokens given")
    return n_units / n_tokens


def bytes_per_token_of_texts(tokenizer: Any, texts: Iterable[str], unit: str = "byte") -> float:
    """Bytes (or characters) per token of raw texts, encoded with `tokenizer`."""
    if unit not in ("byte", "char"):
        raise ValueError(f"unit={unit!r}: use 'byte' or 'char'")
    n_units = n_tokens = 0
    for text in texts:
        n_units += len(text.encode("utf-8")) if unit == "byte" else len(text)
        n_tokens += len(tokenizer.encode(text))
    if n_tokens == 0:
        raise ValueError("bytes_per_token_of_texts: the texts encode to no tokens")
    return n_units / n_tokens


def text_per_token(tok, valid, n: int = 256) -> dict[str, float]:
    """UTF-8 bytes (and, for a character-level tokenizer, characters) per token of the
    validation data, measured once at start for bits per byte / per character."""
    if tok is None or valid is None:
        return {}
    units = {"bytes_per_token": "byte"}
    if getattr(tok, "kind", None) == "chars":
        units["chars_per_token"] = "char"
    out = {}
    for key, unit in units.items():
        with contextlib.suppress(ValueError, NotImplementedError):
            ids = (valid[i]["input_ids"] for i in range(min(n, len(valid))))
            out[key] = bytes_per_token(tok, ids, unit)
    return out
