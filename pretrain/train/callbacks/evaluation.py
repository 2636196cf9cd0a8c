"""Validation loss, perplexity and bits per token / byte / character during training."""

from __future__ import annotations

from pretrain.train.callbacks.base import Callback, StepOutput


class Evaluation(Callback):
    """Every train.eval_interval steps (and at the last), over the same train.eval_iters
    global batches of validation data each time; scalars valid/*, one console line."""

    def on_train_start(self, trainer) -> None:
        from pretrain.data.pipeline import text_per_token

        self.enabled = trainer.eval_enabled
        self.text_per_token = (
            text_per_token(trainer.data.tokenizer, trainer.data.valid)
            if self.enabled and trainer.is_main
            else {}
        )

    def on_step_end(self, trainer, out: StepOutput) -> None:
        t = trainer.cfg.train
        if not self.enabled or (out.step % t.eval_interval and out.step != t.train_iters):
            return
        from pretrain.eval.metrics import evaluate_loss

        results = evaluate_loss(trainer.module, trainer.valid_batches(), **self.text_per_token)
        results.pop("tokens", None)
        results = {f"valid/{k}": v for k, v in results.items()}
        out.scalars.update(results)
        bpb, bpc = results.get("valid/bits_per_byte"), results.get("valid/bits_per_char")
        trainer.log(
            f"step {out.step} | valid loss {results['valid/loss']:.4f} | "
            f"ppl {results['valid/ppl']:.2f} | bits/token {results['valid/bits_per_token']:.4f}"
            + (f" | bits/byte {bpb:.4f}" if bpb is not None else "")
            + (f" | bits/char {bpc:.4f}" if bpc is not None else "")
        )
        trainer.fire("on_evaluation", results)
