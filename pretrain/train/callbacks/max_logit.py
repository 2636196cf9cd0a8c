"""The largest attention logit (q.k / sqrt(d)) per layer: the quantity that runs away before
NoPE's loss spikes, and that QK-Norm keeps bounded."""

from __future__ import annotations

import torch

from pretrain.train.callbacks.base import Callback, StepOutput


@torch.no_grad()
def max_attention_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> list[float]:
    """One eval-mode forward of `input_ids`; the largest pre-softmax logit of each layer."""
    was = model.training
    model.eval()
    model.set_record_max_logit(True)
    try:
        model(input_ids)
        return model.max_attention_logits()
    finally:
        model.set_record_max_logit(False)
        model.train(was)


class MaxLogitMonitor(Callback):
    """stability/max_attn_logit (and per layer) every `interval` steps, on the step's first
    sequence of this rank."""

    def __init__(self, interval: int = 100) -> None:
        self.interval = interval

    def on_step_end(self, trainer, out: StepOutput) -> None:
        if out.step % self.interval or out.first_input is None:
            return
        logits = max_attention_logits(trainer.module, out.first_input)
        for i, v in enumerate(logits):
            out.scalars[f"stability/max_attn_logit/layer_{i:02d}"] = v
        out.scalars["stability/max_attn_logit"] = max(logits)
