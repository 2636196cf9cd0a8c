"""What a person reads: the start-up summary, one line per logged step with ETA, and the end."""

from __future__ import annotations

import math
import time

import torch

from pretrain.train.callbacks.base import Callback, StepOutput


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def format_tokens(n: int) -> str:
    """1_234 -> '1.23K', 100_663_296_000 -> '100.66B': a token count read at a glance."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def describe_positions(model_cfg) -> str:
    """The start-up line's positions: 'rotary dims r/head_dim' when every layer is plain RoPE
    (or NoPE) at one theta, else each run of equal layers (`LayerPosition.describe`):
    'positions by layer: 0-2 RoPE 64/64 (neox, theta 10000), full; 3 NoPE, full'."""
    from pretrain.model.position import layer_positions

    layers = layer_positions(model_cfg)
    texts = [p.describe() for p in layers]
    plain = all(
        p.window is None and not p.alibi and (p.spectrum == "neox" or p.rotary_dims == p.head_dim)
        for p in layers
    )
    if plain and len(set(texts)) == 1:
        return f"rotary dims {model_cfg.rope_dims}/{model_cfg.head_dim}"
    runs, start = [], 0
    for i in range(1, len(texts) + 1):
        if i == len(texts) or texts[i] != texts[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            runs.append(f"{span} {texts[start]}")
            start = i
    return "positions by layer: " + "; ".join(runs)


def spike_policy(c) -> str:
    """What the run does about loss spikes beyond logging them, in words ('' = nothing)."""
    parts = []
    if c.skip_step:
        parts.append("flagged steps apply no update")
    if c.rollback_after:
        parts.append(
            f"{c.rollback_after} flagged of {c.rollback_within} steps roll back to the checkpoint "
            f"before them and skip their data (-{c.rollback_skip_before}/+{c.rollback_skip_after} "
            f"data steps, at most {c.max_rollbacks} times)"
        )
    if c.skip_data:
        parts.append("data steps " + ", ".join(f"{a}-{b}" for a, b in c.skip_data) + " skipped")
    if c.faults:
        parts.append(
            "INJECTED FAULTS at data steps "
            + ", ".join(
                f"{f.step}"
                + (f"-{f.last}" if f.last else "")
                + f" ({f.kind}"
                + (f" on rank {f.rank})" if f.rank is not None else ")")
                for f in c.faults
            )
        )
    return "; ".join(parts)


class ConsoleProgress(Callback):
    """Rank 0's console: model and batch at start, `step i/N | loss | lr | ... | ETA`, the end."""

    def on_train_start(self, trainer) -> None:
        cfg, t, m = trainer.cfg, trainer.cfg.train, trainer.run.module.model
        tokens = trainer.run.tokens_per_step
        trainer.log(
            f"model: {m.num_params() / 1e6:.2f}M parameters ({m.num_params(True) / 1e6:.2f}M "
            f"without embeddings), {describe_positions(cfg.model)}; "
            f"{trainer.run.env.world_size} rank(s) on {trainer.run.device.type}, {t.precision}, "
            f"ZeRO-{t.zero_stage}; global batch {t.global_batch_size} = {t.micro_batch_size} x "
            f"{trainer.run.grad_accum} accumulation x {trainer.run.env.world_size} ranks; "
            f"{tokens:,} tokens/step x {t.train_iters:,} steps = "
            f"{format_tokens(tokens * t.train_iters)} tokens"
        )
        policy = spike_policy(cfg.spikes)
        if policy:
            trainer.log("loss spikes: " + policy)
        self.t_start = time.perf_counter()

    def on_values(self, trainer, outs: list[StepOutput]) -> None:
        for out in outs:
            if out.log:
                self._line(trainer, out)

    def _line(self, trainer, out: StepOutput) -> None:
        s = out.scalars
        tps, mfu = s.get("perf/tokens_per_s", float("nan")), s.get("perf/mfu", float("nan"))
        # The peak is a GPU's (logging.peak_tflops); measured against a CPU it means nothing.
        mfu_text = (
            f"MFU {100 * mfu:.1f}%" if trainer.run.device.type == "cuda" else "MFU n/a on CPU"
        )
        eta = s.get("perf/step_time_s", float("nan")) * (trainer.cfg.train.train_iters - out.step)
        gnorm = out.grad_norm if out.grad_norm is not None else float("nan")
        trainer.log(
            f"step {out.step}/{trainer.cfg.train.train_iters} | loss {out.loss:.4f} | "
            f"lr {out.lr:.3e} | gnorm {gnorm:.3f} | {tps / 1e3:,.1f}k tok/s | {mfu_text} | "
            f"ETA {format_eta(eta)}"
        )

    def on_fit_end(self, trainer, exit_code: int | None) -> None:
        if exit_code == 0 and trainer.train_started:
            trainer.log(f"done: {trainer.step} steps in {time.perf_counter() - self.t_start:.0f}s")


class Samples(Callback):
    """Rank 0 samples a continuation of each of logging.sample_prompts when training ends."""

    def on_fit_end(self, trainer, exit_code: int | None) -> None:
        cfg, tok = trainer.cfg, trainer.run.data.tokenizer if trainer.run else None
        if exit_code != 0 or not trainer.train_started or not trainer.is_main or tok is None:
            return
        gen = torch.Generator(device=trainer.run.device).manual_seed(cfg.train.seed)
        print("samples:", flush=True)
        with torch.no_grad():
            for prompt in cfg.logging.sample_prompts:
                ids = tok.encode(prompt)
                room = cfg.seq_len - len(ids)  # positions the model was trained on
                if not ids or room <= 0:
                    continue
                out = trainer.run.module.model.generate(
                    torch.tensor([ids], device=trainer.run.device),
                    max_new_tokens=min(200, room),
                    temperature=0.8,
                    top_k=50,
                    generator=gen,
                )
                print("-" * 60 + "\n" + tok.decode(out[0].tolist()), flush=True)
        print("-" * 60, flush=True)
