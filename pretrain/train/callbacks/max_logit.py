"""The largest attention logit (q.k / sqrt(d)) per layer: the quantity that runs away before
NoPE's loss spikes, and that QK-Norm keeps bounded. Computed on demand by forward hooks
(pretrain.model.probes), blockwise: the model keeps no monitoring state."""

from __future__ import annotations

from pretrain.model.probes import max_attention_logits
from pretrain.train.callbacks.base import Callback, StepRecord


class MaxLogitMonitor(Callback):
    """stability/max_attn_logit (and per layer) every `interval` steps, on the step's first
    sequence of this rank."""

    def __init__(self, interval: int = 100) -> None:
        self.interval = interval

    def on_step_end(self, trainer, out: StepRecord) -> None:
        if out.step % self.interval or out.first_input is None:
            return
        logits = max_attention_logits(trainer.run.module.model, out.first_input)
        for i, v in enumerate(logits):
            out.scalars[f"stability/max_attn_logit/layer_{i:02d}"] = v
        out.scalars["stability/max_attn_logit"] = max(logits)
