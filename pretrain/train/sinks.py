"""The sinks a run's records go to (pretrain/train/publish.py): the console, the run's
metrics file, TensorBoard, Weights & Biases. Files are written by rank 0.

Every step is written once, in step order, when the trainer publishes it (at logging steps
and before a save, a stop, a rollback and the end; pretrain/train/metrics.py). After a
resume from step k, lines and TensorBoard events past k (written by the run that died) are
dropped, so curves never hold two histories; a rollback to step k drops them the same way and
records itself at step k (spikes/rollbacks, spikes/rollback_from). W&B cannot drop what it
logged: it plots every scalar against the training step (`train/step`, its own x axis), so
the steps a rollback or a resume trained again show as a second curve from step k, not as
rows W&B refuses.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import Config, to_dict
from pretrain.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED
from pretrain.model.position import layer_positions
from pretrain.run_layout import atomic_write, read_metrics
from pretrain.train.callbacks import callback_class
from pretrain.train.callbacks.base import Trainer
from pretrain.train.publish import Sink
from pretrain.train.records import Notice, Record, Rewound, StepOutput


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


def _clean(scalars) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items() if v is not None}


class Console(Sink):
    """Rank 0's console: the model and batch at start, `step i/N | loss | lr | ... | ETA` per
    logged step, a warning per spike, the validation line, rollbacks, the end. A Notice (a
    hang's verdict) prints on whichever rank has it."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.t_start = 0.0

    def open(self, trainer: Trainer) -> None:
        self.trainer, self.t_start = trainer, time.perf_counter()
        cfg, t, m = trainer.cfg, trainer.cfg.train, trainer.run.module.model
        run = trainer.run
        tokens = run.tokens_per_step
        trainer.log(
            f"model: {m.num_params() / 1e6:.2f}M parameters ({m.num_params(True) / 1e6:.2f}M "
            f"without embeddings), {describe_positions(cfg.model)}; "
            f"{run.env.world_size} rank(s) on {run.device.type}, {t.precision}, "
            f"ZeRO-{t.zero_stage}; global batch {t.global_batch_size} = {t.micro_batch_size} x "
            f"{run.grad_accum} accumulation x {run.env.world_size} ranks; "
            f"{tokens:,} tokens/step x {t.train_iters:,} steps = "
            f"{format_tokens(tokens * t.train_iters)} tokens"
        )
        policy = spike_policy(cfg.spikes)
        if policy:
            trainer.log("loss spikes: " + policy)

    def write(self, record: Record) -> None:
        if isinstance(record, Notice):
            print(record.text, flush=True)
        elif self.trainer is None:
            return
        elif isinstance(record, Rewound):
            self.trainer.log(record.text)
        else:
            for tag, text in record.events:
                if tag == "spikes":
                    self.trainer.log("warning: " + text)
            if record.log:
                self.trainer.log(self._step_line(record))
            if "valid/loss" in record.scalars:
                self.trainer.log(_validation_line(record))

    def _step_line(self, out: StepOutput) -> str:
        trainer, s = self.trainer, out.scalars
        tps, mfu = s.get("perf/tokens_per_s", float("nan")), s.get("perf/mfu", float("nan"))
        # The peak is a GPU's (logging.peak_tflops); measured against a CPU it means nothing.
        mfu_text = (
            f"MFU {100 * mfu:.1f}%" if trainer.run.device.type == "cuda" else "MFU n/a on CPU"
        )
        eta = s.get("perf/step_time_s", float("nan")) * (trainer.cfg.train.train_iters - out.step)
        gnorm = s.get("train/grad_norm", float("nan"))
        return (
            f"step {out.step}/{trainer.cfg.train.train_iters} | loss {s['train/loss']:.4f} | "
            f"lr {s['train/lr']:.3e} | gnorm {gnorm:.3f} | {tps / 1e3:,.1f}k tok/s | {mfu_text} | "
            f"ETA {format_eta(eta)}"
        )

    def close(self, trainer: Trainer, exit_code: int | None) -> None:
        if exit_code == EXIT_OK and self.trainer is not None:
            trainer.log(f"done: {trainer.step} steps in {time.perf_counter() - self.t_start:.0f}s")


def _validation_line(out: StepOutput) -> str:
    """Validation loss, perplexity and bits per token / byte / character (the Validation
    evaluator's, every train.eval_interval steps and at the last)."""
    r = out.scalars
    bpb, bpc = r.get("valid/bits_per_byte"), r.get("valid/bits_per_char")
    return (
        f"step {out.step} | valid loss {r['valid/loss']:.4f} | "
        f"ppl {r['valid/ppl']:.2f} | bits/token {r['valid/bits_per_token']:.4f}"
        + (f" | bits/byte {bpb:.4f}" if bpb is not None else "")
        + (f" | bits/char {bpc:.4f}" if bpc is not None else "")
    )


class MetricsFile(Sink):
    """The run's metrics file (pretrain.run_layout): one JSON object per step,
    {"step": 120, "train/loss": 3.1, ...}, so tools read runs without TensorBoard
    (pretrain.run_layout.read_metrics)."""

    def __init__(self) -> None:
        self.file = None
        self.path = None

    def open(self, trainer: Trainer) -> None:
        if trainer.is_main:
            self.path = trainer.layout.metrics
            self._reopen(trainer.step)

    def _reopen(self, step: int, extra: dict[str, Any] | None = None) -> None:
        if self.path.is_file():  # keep what the resumed checkpoint had seen
            rows = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
            rows += [extra] if extra else []
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in rows), fsync=False)
        # Line-buffered: a kill loses at most the line being written.
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close)

    def write(self, record: Record) -> None:
        if self.file is None:
            return
        if isinstance(record, StepOutput):
            self.file.write(json.dumps({"step": record.step, **_clean(record.scalars)}) + "\n")
        elif isinstance(record, Rewound):
            self.file.close()
            self._reopen(record.step, {"step": record.step, **record.scalars})

    def close(self, trainer: Trainer, exit_code: int | None) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class TensorBoard(Sink):
    """RUN/tensorboard/: every scalar, spike events and notices as text, the evaluators'
    images, the resolved config at step 0."""

    def __init__(self) -> None:
        self.writer = None
        self.folder = None

    def open(self, trainer: Trainer) -> None:
        if not trainer.is_main:
            return
        self.folder = str(trainer.layout.tensorboard)
        # purge_step hides events past the checkpoint written by a run that died later.
        self.writer = _summary_writer(self.folder, trainer.step + 1 if trainer.step else None)
        if trainer.step == 0:
            self.writer.add_text(
                "config",
                "```\n" + yaml.safe_dump(to_dict(trainer.cfg), sort_keys=False) + "\n```",
                0,
            )

    def write(self, record: Record) -> None:
        if self.writer is None:
            return
        if isinstance(record, StepOutput):
            for k, v in _clean(record.scalars).items():
                self.writer.add_scalar(k, v, record.step)
            for tag, text in record.events:
                self.writer.add_text(tag, text, record.step)
            for tag, image in record.images.items():
                self.writer.add_image(tag, image, record.step, dataformats="HWC")
        elif isinstance(record, Rewound):
            self.writer.close()  # reopened to purge the steps the rollback went back past
            self.writer = _summary_writer(self.folder, record.step + 1)
            for k, v in record.scalars.items():
                self.writer.add_scalar(k, v, record.step)
            self.writer.add_text("spikes", record.text, record.step)
        else:
            self.writer.add_text(record.tag, record.text, record.step)
            self.writer.flush()  # a hang's verdict: the process exits next

    def flush(self) -> None:
        # On disk with the checkpoint: a run that dies later (a kill, a hang's exit) and
        # resumes from it has every event up to it (the ones after are purged anyway).
        if self.writer is not None:
            self.writer.flush()

    def close(self, trainer: Trainer, exit_code: int | None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _summary_writer(folder: str, purge_step: int | None):
    """A writer whose event file TensorBoard reads after the folder's others. TensorBoard
    reads a folder's files in name order, and a name is events.out.tfevents.SECONDS.HOST.
    PID.N: two writers of one process within one second whose counters N cross a power of
    ten (9, 10) sort the wrong way, and the later one's purge would be read first (a resume
    or a rollback soon after the start, as in the tests). Such a file is made again in the
    next second."""
    from torch.utils.tensorboard import SummaryWriter  # tensorboard's import is slow

    def names() -> set[str]:
        return {p.name for p in Path(folder).glob("events.out.tfevents.*")}

    before = names()
    writer = SummaryWriter(folder, purge_step=purge_step)
    while before and (new := names() - before) and max(new) < max(before):
        writer.close()
        for name in new:
            (Path(folder) / name).unlink()
        time.sleep(1.01 - time.time() % 1)
        writer = SummaryWriter(folder, purge_step=purge_step)
    return writer


class Wandb(Sink):
    """The same scalars in a Weights & Biases run (section `wandb:` of the config), against
    the training step `train/step`; a resumed run continues the same W&B run (its id is kept
    in the checkpoints: Trainer saves `state_dict`)."""

    STEP = "train/step"
    state_key = "wandb"

    def __init__(
        self,
        project: str = "pretrain",
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: str | None = None,
    ) -> None:
        self.options = dict(
            project=project, entity=entity, name=name, group=group, tags=list(tags or []), mode=mode
        )
        self.run_id: str | None = None
        self.run = None

    def open(self, trainer: Trainer) -> None:
        if not trainer.is_main:
            return
        import wandb

        opts = dict(self.options)
        opts["name"] = opts["name"] or trainer.layout.root.name
        self.run_id = self.run_id or secrets.token_hex(6)  # a W&B run id: [a-z0-9]
        self.run = wandb.init(
            id=self.run_id,
            resume="allow",
            dir=str(trainer.layout.root),
            config=to_dict(trainer.cfg),
            **opts,
        )
        # W&B's own step only grows and drops a row logged at a smaller one; the training
        # step is an axis of its own, so the steps after a rollback are kept.
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)

    def write(self, record: Record) -> None:
        if self.run is None or isinstance(record, Notice):
            return
        self.run.log({self.STEP: record.step, **_clean(record.scalars)})

    def close(self, trainer: Trainer, exit_code: int | None) -> None:
        if self.run is not None:
            ok = exit_code in (EXIT_OK, EXIT_PREEMPTED)
            self.run.finish(exit_code=EXIT_OK if ok else EXIT_FAILED)
            self.run = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")


def build_sinks(cfg: Config) -> list[Sink]:
    """The sinks a config asks for, in the order they write: the console, the metrics file,
    TensorBoard (logging.tensorboard), W&B (wandb.enabled), then the user's own (a
    `callbacks:` entry that names a Sink)."""
    out: list[Sink] = [Console(), MetricsFile()]
    if cfg.logging.tensorboard:
        out.append(TensorBoard())
    if cfg.wandb.enabled:
        w = cfg.wandb
        out.append(Wandb(w.project, w.entity, w.name, w.group, w.tags, w.mode))
    for i, spec in enumerate(cfg.callbacks):
        cls = callback_class(spec, f"callbacks[{i}]")
        if issubclass(cls, Sink):
            out.append(cls(**{k: v for k, v in spec.items() if k != "class"}))
    return out
