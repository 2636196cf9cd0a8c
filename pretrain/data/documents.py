"""Documents inside a packed sequence: which document each token belongs to, and its position
in that document (data.document_mask, data.position_reset, data.eod_mask_loss).

Pretraining packs documents back to back, each ended by the end-of-document (EOD) token. A
token belongs to the document its EOD ends, so the EOD is the last token of its document
and the next token starts the next one, as megatron-core's `reset_attention_mask` and
`reset_position_ids` cut them. The first token of a sample may sit in the middle of a
document: it starts that sample's document 0 (positions from 0), as megatron's do.

One function turns token ids into the model's keyword arguments, so training, validation,
evaluation by position and the harness compute them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pretrain.config import DataConfig
from pretrain.errors import UserError

# The batch keys that are the model's keyword arguments (TokenDataset puts them beside the
# tokens when a switch is on).
MODEL_INPUT_KEYS = ("document_ids", "position_ids")


def model_inputs_of(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The document inputs a batch carries, on `device`: what the model's forward takes
    beside the tokens (empty with the switches off). With positions made on the host, also
    their largest (`max_position`), read there: the model then never reads the positions
    back from a GPU, a synchronisation every micro batch."""
    out: dict[str, Any] = {k: batch[k].to(device) for k in MODEL_INPUT_KEYS if k in batch}
    positions = batch.get("position_ids")
    if positions is not None and positions.device.type == "cpu" and positions.numel():
        out["max_position"] = int(positions.max())
    return out


class DocumentError(UserError, ValueError):
    """A document switch cannot work with this data; the message says the fix."""


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(..., T) int64: the number of EOD tokens strictly before each token (an exclusive
    cumulative count), so an EOD keeps the id of the document it ends."""
    is_eod = (tokens == eod).to(torch.int64)
    return torch.cumsum(is_eod, dim=-1) - is_eod


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(..., T) int64: each token's position in its document, from 0 at each document's start
    (the first token of the row starts a document)."""
    T = doc_ids.shape[-1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    start_of = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - start_of


def attended_fraction(lengths: np.ndarray, seq_len: int) -> float:
    """With document masking, the share of a causal row's (query, key) pairs that are attended,
    over rows of `seq_len` tokens cut from documents of `lengths` packed back to back (as
    megatron-core's samples are): sum over the pieces of each row of L (L + 1) / 2, over
    rows x T (T + 1) / 2. 1.0 when every row lies inside one document."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    total = int(lengths.sum())
    rows = total // seq_len
    if rows == 0:
        raise ValueError(f"the documents hold {total} tokens: fewer than one row of {seq_len}")
    end = rows * seq_len
    doc_ends = np.cumsum(lengths)
    cuts = np.union1d(doc_ends[doc_ends < end], np.arange(0, end + 1, seq_len))
    pieces = np.diff(cuts)
    attended = float((pieces * (pieces + 1) // 2).sum())
    return attended / (rows * seq_len * (seq_len + 1) / 2)


@dataclass(frozen=True)
class DocumentSwitches:
    """data.document_mask, data.position_reset and data.eod_mask_loss with the EOD id they cut
    at; all off is the paper's runs (attention and positions run across documents)."""

    eod: int | None = None
    document_mask: bool = False
    position_reset: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def of(
        cls, data: DataConfig, eod: int | None, where: str = "the tokenizer"
    ) -> DocumentSwitches:
        on = [
            name
            for name in ("document_mask", "position_reset", "eod_mask_loss")
            if getattr(data, name)
        ]
        if on and eod is None:
            raise DocumentError(
                f"data.{on[0]} needs an end-of-document token, and {where} has none "
                f"(character-level data has no documents to cut at); set data.{on[0]}=false"
            )
        return cls(eod, data.document_mask, data.position_reset, data.eod_mask_loss)

    def model_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for these token ids (B, T) or (T,): `document_ids`
        with document_mask, `position_ids` with position_reset, nothing when both are off."""
        out: dict[str, Any] = {}
        if self.eod is None or not (self.document_mask or self.position_reset):
            return out
        ids = document_ids(input_ids, self.eod)
        if self.document_mask:
            out["document_ids"] = ids
        if self.position_reset:
            out["position_ids"] = document_positions(ids)
        return out

    def mask_labels(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """With eod_mask_loss, labels whose input token is an EOD (the next document's first
        token is its target) become -100; otherwise `labels` unchanged."""
        if not self.eod_mask_loss or self.eod is None:
            return labels
        return labels.masked_fill(input_ids == self.eod, -100)
