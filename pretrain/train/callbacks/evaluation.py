"""The console line of a validation pass (the trainer runs its evaluators:
pretrain/train/evaluators/)."""

from __future__ import annotations

from pretrain.train.callbacks.base import Callback, StepOutput


class Evaluation(Callback):
    """Validation loss, perplexity and bits per token / byte / character: every
    train.eval_interval steps (and at the last), over the same train.eval_iters global batches
    of validation data each time (the Validation evaluator). This prints its line after the
    step's own."""

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        for out in outs:
            r = out.evaluation
            if r and "valid/loss" in r:
                self._line(trainer, out, r)

    def _line(self, trainer, out: StepOutput, r) -> None:
        bpb, bpc = r.get("valid/bits_per_byte"), r.get("valid/bits_per_char")
        trainer.log(
            f"step {out.step} | valid loss {r['valid/loss']:.4f} | "
            f"ppl {r['valid/ppl']:.2f} | bits/token {r['valid/bits_per_token']:.4f}"
            + (f" | bits/byte {bpb:.4f}" if bpb is not None else "")
            + (f" | bits/char {bpc:.4f}" if bpc is not None else "")
        )


__all__ = ["Evaluation"]
