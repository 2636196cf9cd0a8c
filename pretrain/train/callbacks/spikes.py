"""Loss spikes made visible: scalars, text events and console lines for what the StepGuard
(pretrain/train/spikes.py) judged: flagged steps, skipped updates, rollbacks."""

from __future__ import annotations

from pretrain.train.callbacks.base import Callback, StepOutput


class SpikeMonitor(Callback):
    """Every step: spikes/loss_score and spikes/grad_norm_score (robust z-scores, once the
    window holds enough steps). A loss spike: spikes/loss, spikes/expected_loss, spikes/score;
    a grad-norm spike: spikes/grad_norm, spikes/expected_grad_norm, spikes/grad_norm_spike_score;
    a skipped update: spikes/skipped = 1 and spikes/skipped_steps (the run's count). Each with
    a text event and one console line. The decisions use all-reduced values, so every rank
    sees the same spikes. Each step when its values are read (on_values: at logging steps,
    or every step with spikes.skip_step or rollback_after), before the writers write it."""

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        for out in outs:
            self._report(trainer, out)

    def _report(self, trainer, out: StepOutput) -> None:
        v = out.verdict
        if v is None:
            return
        sc = out.scalars
        if v.loss_score is not None:
            sc["spikes/loss_score"] = v.loss_score
        if v.grad_score is not None:
            sc["spikes/grad_norm_score"] = v.grad_score
        lines = []
        if v.loss_spike is not None:
            sp = v.loss_spike
            sc.update(
                {
                    "spikes/loss": sp.value,
                    "spikes/expected_loss": sp.expected,
                    "spikes/score": sp.score,
                }
            )
            lines.append(
                f"loss spike at step {v.step}: loss {sp.value:.4f}, expected {sp.expected:.4f} "
                f"(robust z-score {sp.score:.1f})"
            )
        if v.grad_spike is not None:
            sp = v.grad_spike
            sc.update(
                {
                    "spikes/grad_norm": sp.value,
                    "spikes/expected_grad_norm": sp.expected,
                    "spikes/grad_norm_spike_score": sp.score,
                }
            )
            lines.append(
                f"grad-norm spike at step {v.step}: grad norm {sp.value:.4g}, expected "
                f"{sp.expected:.4g} (robust z-score {sp.score:.1f})"
            )
        if v.skipped:
            sc["spikes/skipped"] = 1.0
            sc["spikes/skipped_steps"] = float(v.skipped_total)
            lines.append(
                f"step {v.step} skipped: no update applied ({v.reason}; data step {v.data_step})"
            )
        elif out.log:
            sc["spikes/skipped_steps"] = float(v.skipped_total)
        for line in lines:
            trainer.log("warning: " + line)
            out.events.append(("spikes", line))
