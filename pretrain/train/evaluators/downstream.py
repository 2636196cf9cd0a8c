"""Downstream tasks during training: the offline tool's tasks, scored by the training model.

    downstream:
      tasks: [piqa, arc_easy, lambada_openai]
      data_dir: ../shared/data/evals        # what tools/evaluate.py --data-dir reads
      examples: 500                         # per task, the same ones every time
      interval: 1000                        # and at the end

Every `interval` steps and at the last, each task's chosen documents are scored through the
offline tool's own path: lm-eval's `simple_evaluate` with our adapter (PretrainLM) around
the training model as it is (no copy of the weights, no checkpoint), the documents sharded
over the ranks by the harness and gathered on rank 0. The figures are therefore those of
tools/evaluate.py on the checkpoint of that step for the same documents; scalars
downstream/<task>/{acc,acc_norm,perplexity,bits_per_byte} go through the one metrics path
(metrics.jsonl, TensorBoard, W&B), each document's loglikelihoods to
RUN/downstream/step_NNNNNNN.json, the chosen documents to RUN/downstream/examples.json.

Refused before the first step: unknown tasks (pretrain/eval/config.py), missing data
(pretrain/preflight.py), and documents whose continuation alone is longer than the model's
context (set-up here). A task that fails during the run is logged and left out from then on;
training goes on.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from pretrain.config import ConfigError, DownstreamConfig
from pretrain.data.documents import DocumentSwitches
from pretrain.eval.harness import PretrainLM
from pretrain.eval.suite import (
    choose_examples,
    downstream_scalars,
    harness_on,
    local_tasks,
    sample_loglikelihoods,
)
from pretrain.eval.tasks import resolve_tasks
from pretrain.run_layout import atomic_write
from pretrain.train.evaluators.base import Evaluator
from pretrain.train.metrics import StepRecord

DOWNSTREAM_DIR = "downstream"
EXAMPLES_FILE = "examples.json"


class DownstreamEvaluation(Evaluator):
    def __init__(self, cfg: DownstreamConfig) -> None:
        self.cfg = cfg
        self.tasks = resolve_tasks(",".join(cfg.tasks)) if cfg.tasks else []
        self.failed: dict[str, str] = {}  # task -> why it is left out
        self.manager: Any = None
        self.task_objs: dict[str, Any] = {}
        self.samples: dict[str, list[int]] = {}
        self.documents = DocumentSwitches()

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: Any) -> None:
        cfg, run = self.cfg, trainer.run
        self.manager, self.task_objs = local_tasks(self.tasks, cfg.data_dir)
        self.samples = choose_examples(self.task_objs, cfg.examples, cfg.seed)
        tok = run.data.tokenizer
        self.documents = DocumentSwitches.of(trainer.cfg.data, tok.eod_id, "the run's tokenizer")
        with self._adapter(trainer) as lm:
            self._check_lengths(lm)
        if trainer.is_main:
            folder = trainer.layout.root / DOWNSTREAM_DIR
            folder.mkdir(parents=True, exist_ok=True)
            record = {
                "seed": cfg.seed,
                "examples": cfg.examples,
                "data_dir": str(cfg.data_dir),
                "documents": {t: len(self.task_objs[t].eval_docs) for t in self.tasks},
                "samples": self.samples,
            }
            atomic_write(folder / EXAMPLES_FILE, json.dumps(record, indent=1) + "\n")
            sizes = ", ".join(f"{t} {len(self.samples[t])}" for t in self.tasks)
            when = f"every {cfg.interval} steps and " if cfg.interval else ""
            trainer.log(f"downstream: {sizes} documents, {when}at the end")

    def _adapter(self, trainer: Any) -> _Adapter:
        return _Adapter(self, trainer)

    def _check_lengths(self, lm: PretrainLM) -> None:
        """A continuation longer than the context cannot be scored (the offline tool refuses
        it too): say so now, not at the first evaluation hours in."""
        for name, task in self.task_objs.items():
            task.build_all_requests(samples=self.samples[name], rank=0, world_size=1)
            longest = 0
            for inst in task.instances:
                if inst.request_type != "loglikelihood":
                    continue
                ctx, cont = inst.args
                enc = lm.tok_encode(cont) if ctx == "" else lm._encode_pair(ctx, cont)[1]
                longest = max(longest, len(enc))
            if longest > lm.max_length:
                raise ConfigError(
                    f"downstream.tasks: {name} has continuations of up to {longest} tokens, "
                    f"longer than the model's context (model.max_seq_len={lm.max_length}); "
                    f"leave {name} out of downstream.tasks or raise model.max_seq_len"
                )

    # ------------------------------------------------------------------ the schedule
    def due(self, step: int, last: bool, stopping: bool) -> bool:
        # Due by step number alone: a rollback that revisits a step evaluates it again with
        # the new weights, and a resumed run (its checkpoint saved after the step's
        # evaluation) neither repeats nor skips one.
        return bool(self.tasks) and (
            last or (self.cfg.interval > 0 and step % self.cfg.interval == 0)
        )

    # ------------------------------------------------------------------ an evaluation
    def run(self, trainer: Any, record: StepRecord) -> dict[str, float]:
        t0 = time.perf_counter()
        scalars: dict[str, float] = {}
        lls: dict[str, dict[int, list[float]]] = {}
        with self._adapter(trainer) as lm:
            for name, task in self.task_objs.items():
                if name in self.failed:
                    continue
                results, error = None, None
                try:
                    results = harness_on(lm, {name: task}, self.manager, {name: self.samples[name]})
                except Exception as e:  # a task's failure must not end the training
                    error = f"{type(e).__name__}: {e}"
                # Every rank leaves the task out together, or none does.
                if _any_rank(error is not None, trainer.run.device):
                    self.failed[name] = error or "failed on another rank"
                    trainer.log(
                        f"downstream: {name} failed at step {record.step} "
                        f"({self.failed[name]}); left out from now on"
                    )
                    continue
                if results is not None:  # rank 0
                    scalars.update(downstream_scalars(results, {name: task}))
                    lls.update(sample_loglikelihoods(results))
        seconds = time.perf_counter() - t0
        if trainer.is_main:
            folder = trainer.layout.root / DOWNSTREAM_DIR
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(
                folder / f"step_{record.step:07d}.json",
                json.dumps({"step": record.step, "loglikelihoods": lls}) + "\n",
                fsync=False,
            )
            shown = " | ".join(
                f"{k} {v:.4g}" for k, v in scalars.items() if not k.endswith("bits_per_byte")
            )
            trainer.log(f"step {record.step} | downstream {shown} | {seconds:.1f} s")
        out = {f"downstream/{k}": v for k, v in scalars.items()}
        out["downstream/seconds"] = seconds
        return _from_rank0(out)


class _Adapter:
    """PretrainLM around the training model for one evaluation, leaving the model in the
    mode it found it (the adapter switches it to eval: dropout off)."""

    def __init__(self, owner: DownstreamEvaluation, trainer: Any) -> None:
        self.owner, self.trainer = owner, trainer

    def __enter__(self) -> PretrainLM:
        run, cfg = self.trainer.run, self.owner.cfg
        self.model = run.module.model
        self.was_training = self.model.training
        return PretrainLM(
            model=self.model,
            tokenizer=run.data.tokenizer,
            documents=self.owner.documents,
            batch_size=cfg.batch_size,
            max_batch_tokens=cfg.max_batch_tokens,
            distributed=True,
            progress=False,
        )

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _any_rank(flag: bool, device: torch.device) -> bool:
    if not _dist():
        return flag
    t = torch.tensor(float(flag), device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _from_rank0(values: dict[str, float]) -> dict[str, float]:
    """The scalars on every rank (rank 0 computed them; an evaluator returns the same
    values everywhere)."""
    if not _dist():
        return values
    box = [values]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
