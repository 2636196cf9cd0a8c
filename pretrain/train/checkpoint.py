"""Checkpoints that survive being killed at any moment, and auto-resume.

One checkpoint is a folder RUN/checkpoints/step_0001000/ (names: pretrain/run_layout.py) holding
    DeepSpeed's files            model, optimizer (ZeRO shards), LR scheduler
    rng/rank_00000.pt ...        python, numpy and torch RNG states of every rank, as tensors
                                 and plain data (pretrain/train/state_files.py)
    trainer_state.json           step, samples and tokens consumed, data position, the
                                 resolved config, callbacks' state, and the size and CRC-32
                                 of every other file (written last: the completion marker)
    model.safetensors            consolidated weights, the run config, tokenizer/: a weights
                                 folder that evaluation and export read without DeepSpeed

How a kill cannot break it: everything is written into step_0001000.tmp/, fsynced, and
only then renamed to step_0001000/ (an atomic rename); `latest` is rewritten through a
temporary file and os.replace. A folder without `.tmp` is therefore complete. Retention
renames old folders to `.deleting` before removing them, so a kill during removal leaves
nothing that looks complete. Leftovers (`*.tmp`, `*.deleting`) are cleaned at start.

How a damaged file cannot stop a run: resuming verifies the newest complete checkpoint
against its marker (sizes, and CRC-32 unless checkpoint.verify says "size"), the ranks
sharing the files between them; a damaged one gets one warning naming what is wrong, and
the previous complete checkpoint is tried, down to the oldest. A checkpoint whose marker
records no files (written before markers did) cannot be checked: it is used, with one warning.
`tools/check_checkpoint.py` runs the same check offline.

What a checkpoint cannot do: run code through our files. The RNG files, the marker and the
weights folder are data (pretrain/train/state_files.py); a resume reads this rank's RNG file
before DeepSpeed's, and refuses one that is not ours in one line. DeepSpeed's own files stay
pickles that it loads with weights_only=False: integrity (CRC-32) is not trust, and
docs/checkpoints.md ("Trust") says which run folders to resume.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.config import CheckpointConfig
from pretrain.errors import UserError
from pretrain.faults import die, fault_point, kill_requested
from pretrain.integrity import (
    UNVERIFIED,
    checkpoint_files,
    file_record,
    is_unverified,
    verify_checkpoint,
)
from pretrain.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    DELETING_SUFFIX,
    LATEST_FILE,
    RNG_DIR,
    STATE_FILE,
    TMP_SUFFIX,
    UNIVERSAL_DIR,
    CheckpointSaveError,
    atomic_write,
    fsync_dir,
    fsync_tree,
    step_tag,
    tag_step,
)
from pretrain.train.async_save import AsyncWriter, DeepSpeedFiles, say
from pretrain.train.distributed import barrier
from pretrain.train.reshard import (
    ReshardError,
    convert_to_universal,
    load_location,
    needs_universal,
    saved_ranks,
    universal_loading,
)
from pretrain.train.state_files import (
    RngStateError,
    read_rng_state,
    reseed,
    rng_state,
    set_rng_state,
)
from pretrain.weights import WEIGHTS_FILE, WeightsError, parse_init_from


def _fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(folder: Path) -> bool:
    return (
        folder.is_dir()
        and folder.name.startswith("step_")
        and not folder.name.endswith((TMP_SUFFIX, DELETING_SUFFIX))
        and (folder / STATE_FILE).is_file()
    )


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint tags, oldest first (tags sort by step)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if is_complete(p))


class CheckpointError(UserError, ValueError):
    """No checkpoint of a run can be loaded; the message names them and the way out."""

    label = "checkpoint error"


def _share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def _gather(values: list) -> list:
    """Every rank's list, concatenated, on every rank (just `values` without a process group)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return values
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, values)
    return [v for part in out for v in part]


def find_resume_tag(
    ckpt_dir: Path,
    verify: str = "checksum",
    rank: int = 0,
    world_size: int = 1,
    before: int | None = None,
) -> str | None:
    """The newest checkpoint that is not found damaged (`latest` first when complete), of a
    step below `before` when given (a rollback's target).

    verify: "checksum", "size" or "none". Every rank calls it with the process group up (or
    one process without): the ranks share the files to check and agree on the result.
    A damaged checkpoint is skipped with one warning; when checkpoints exist but none is
    intact, CheckpointError says so. An unverified one (a marker without a file list: see
    integrity.is_unverified) is taken, with one warning, when it is the newest not damaged;
    a newer verified one is taken before it. Passing it over for an older verified one would
    throw training away, and hardly happens: file lists came with newer code, so in a run
    that holds both, the verified checkpoints are the newer ones.
    """
    tags = complete_tags(ckpt_dir)
    if before is not None:
        tags = [t for t in tags if tag_step(t) < before]
    latest = ckpt_dir / LATEST_FILE
    named = latest.read_text().strip() if latest.is_file() else ""
    if named in tags:  # `latest` wins over a newer folder (e.g. one saved after a rollback)
        tags = [t for t in tags if t != named] + [named]
    damaged = []
    for tag in reversed(tags):
        folder = ckpt_dir / tag
        unverified = False
        if verify == "none":
            problems = []
        else:
            try:
                recorded = sorted(read_state(folder).get("files") or {})
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                recorded = None  # the marker itself is damaged: every rank sees that alike
            share = None if recorded is None else _share(recorded, rank, world_size)
            problems = _gather(verify_checkpoint(folder, verify == "checksum", share))
            if recorded is None:
                problems = problems[:1]
            unverified = not problems and is_unverified(folder)  # the same marker on every rank
        if not problems:
            if rank == 0 and unverified:
                newest = ", the newest not damaged" if damaged else ""
                print(f"warning: using checkpoint {folder}{newest}; {UNVERIFIED}", flush=True)
            elif rank == 0 and damaged:
                print(f"warning: resuming from {tag}, the newest intact checkpoint", flush=True)
            return tag
        damaged.append(tag)
        if rank == 0:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            print(
                f"warning: checkpoint {folder} is damaged: {problems[0]}{more}; "
                f"falling back to the previous one",
                flush=True,
            )
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {ckpt_dir} ({', '.join(damaged)} damaged; "
            f"python tools/check_checkpoint.py shows what is wrong); move them away, or "
            f"--set checkpoint.resume=false to start the run over"
        )
    return None


def read_state(folder: Path) -> dict[str, Any]:
    """The marker (run_layout.STATE_FILE) of a complete checkpoint folder."""
    return json.loads((Path(folder) / STATE_FILE).read_text())


def clean_leftovers(ckpt_dir: Path) -> None:
    """Remove half-written (`.tmp`) and half-deleted (`.deleting`) folders (rank 0, at start)."""
    if not ckpt_dir.is_dir():
        return
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            shutil.rmtree(p, ignore_errors=True)
        elif is_complete(p):  # a re-partitioning cut short (pretrain/train/reshard.py)
            shutil.rmtree(p / (UNIVERSAL_DIR + TMP_SUFFIX), ignore_errors=True)


class _OnDisk:
    """DeepSpeed's files of a synchronous save: written by DeepSpeed in the save step."""

    def write(self) -> list[str]:
        return []


class SyncWriter:
    """The synchronous writer (checkpoint.async off): DeepSpeed writes its files through its
    own checkpoint engine, and the rest of the protocol runs in the save step, on the main
    thread, its collectives on the default group."""

    asynchronous = False

    def __init__(self) -> None:
        self._failed: tuple[int, str] | None = None

    def capture(self, engine: Any, step: int, save: Callable[[], None]) -> DeepSpeedFiles:
        save()
        return _OnDisk()

    def keep(self, obj: Any) -> Any:
        return obj  # nothing changes it before the save step ends

    def weights(self, module: Any) -> None:
        return None  # write_weights reads the model itself, in this very step

    def seal(self) -> None:
        pass

    def start(self, step: int, work: Callable[[], str | None]) -> None:
        error = work()
        self._failed = (step, error) if error else None

    def wait(self) -> tuple[int, str] | None:
        failed, self._failed = self._failed, None
        return failed

    def gather(self, obj: Any) -> list[Any]:
        return _gather([obj])


@dataclass
class _Save:
    """One checkpoint on its way to disk: what the save step captured for the writer."""

    step: int
    tmp: Path
    final: Path
    t0: float  # when the save step began
    files: DeepSpeedFiles  # DeepSpeed's, as the writer holds them
    weights: Any  # rank 0: what write_weights writes (None: the model as it is)
    rng: dict[str, Any]
    state: dict[str, Any]
    write_weights: Callable[..., None]


def _error_of(work: Callable[[], None]) -> str | None:
    """The text of what `work` raised, None when it returned: every rank reports its outcome
    in one gather instead of raising alone while the others wait in a collective."""
    try:
        work()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class Checkpointer:
    """Save/load through a DeepSpeed engine; rank 0 owns the folder operations.

    One save protocol (`save`, then `_write`), two writers: SyncWriter writes in the save
    step; with checkpoint.async an AsyncWriter (pretrain/train/async_save.py) takes a host
    copy and returns while a thread writes it, and `wait()` blocks until it is on disk. Every
    save, load and rollback waits for the save in flight first; so do the end of a run
    and a pre-emption (pretrain/train/checkpoint_schedule.py).
    """

    def __init__(self, ckpt_dir: Path, cfg: CheckpointConfig, rank: int, world_size: int):
        self.dir = Path(ckpt_dir)
        self.keep_last = cfg.keep_last
        self.verify = cfg.verify  # also how a reused universal form is checked
        self.rank = rank
        self.world_size = world_size
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.dir)
        # checkpoint.async: the writer thread and its process group (made by every rank)
        self.writer: SyncWriter | AsyncWriter = AsyncWriter() if cfg.async_ else SyncWriter()
        barrier()

    def save(self, engine, step: int, state: dict[str, Any], write_weights) -> Path:
        """Write checkpoint `step`; `write_weights(folder, weights=None)` adds the weights
        folder's files (rank 0; `weights`: a host copy of `weights_state(engine.module)`).

        Every rank must call it. Returns the final folder (complete on return, or, with
        checkpoint.async, once `wait()` returns).
        """
        self.wait()
        tag = step_tag(step)
        final = self.dir / tag
        tmp = self.dir / (tag + TMP_SUFFIX)
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        barrier()
        t0 = time.perf_counter()
        w = self.writer
        files = w.capture(
            engine,
            step,
            lambda: engine.save_checkpoint(
                str(self.dir), tag=tmp.name, client_state={}, save_latest=False
            ),
        )
        job = _Save(
            step,
            tmp,
            final,
            t0,
            files,
            weights=w.weights(engine.module) if self.rank == 0 else None,
            rng=rng_state(),
            state=w.keep(state),  # callbacks' lists and dicts go on changing
            write_weights=write_weights,
        )
        w.seal()
        if self.rank == 0 and w.asynchronous:
            say(
                f"writing checkpoint {final} in the background (copied in "
                f"{time.perf_counter() - t0:.2f} s)"
            )
        w.start(step, lambda: self._write(job))
        if not w.asynchronous:
            self.wait()  # its error, raised now
        return final

    def _write(self, job: _Save) -> str | None:
        """(Every rank, in the writer: the save step or the writer thread.) This rank's files;
        once every rank's are on disk, the sizes and CRC-32s of every file, the ranks sharing
        the reading; then rank 0 commits. Returns the save's error (the same on every rank),
        None when it is complete."""
        error = self._first(self.writer.gather(_error_of(lambda: self._write_own_files(job))))
        if error:
            return error
        records: list[tuple[str, dict]] = []

        def read_share() -> None:
            files = checkpoint_files(job.tmp)
            for rel in _share(files, self.rank, self.world_size):
                records.append((rel, file_record(job.tmp / rel)))

        outcomes = self.writer.gather((_error_of(read_share), records))
        error = self._first([err for err, _ in outcomes])
        if error:
            return error
        if self.rank == 0:
            recorded = dict(rec for _, part in outcomes for rec in part)
            error = _error_of(
                lambda: self._commit(job.step, job.state, recorded, job.tmp, job.final)
            )
            if error is None:
                took = time.perf_counter() - job.t0
                how = f" (in the background: {took:.1f} s)" if self.writer.asynchronous else ""
                say(f"saved checkpoint {job.final}{how}")
        return self._first(self.writer.gather(error))

    def _write_own_files(self, job: _Save) -> None:
        written = job.files.write()
        rng_file = self._rng_file(job.tmp)
        rng_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(job.rng, rng_file)
        written.append(str(rng_file))
        fault_point("after_engine_save", job.step)
        if self.rank == 0:
            # The one-argument call, as ever, where the writer copied no weights.
            args = () if job.weights is None else (job.weights,)
            job.write_weights(job.tmp, *args)
            fault_point("after_weights", job.step)
        # Durable before rank 0 commits: its fsync of the folder reaches no other node's cache.
        for path in written:
            _fsync_file(path)

    def _first(self, errors: list[str | None]) -> str | None:
        """The first rank's error of a gather, naming the rank when there are several."""
        for rank, error in enumerate(errors):
            if error:
                return f"{error} (rank {rank})" if self.world_size > 1 else error
        return None

    def _commit(self, step: int, state, records: dict, tmp: Path, final: Path) -> None:
        """(Rank 0, every file of every rank on disk.) The marker with the files' `records`,
        fsync, the rename to `final`, `latest`, retention."""
        state = {
            **state,
            "step": step,
            "world_size": self.world_size,
            "saved_at": time.time(),
            "files": dict(sorted(records.items())),
        }
        text = json.dumps(state, indent=1)
        if kill_requested("mid_marker", step):  # half the marker on disk, then the kill
            (tmp / STATE_FILE).write_text(text[: len(text) // 2])
            die()
        (tmp / STATE_FILE).write_text(text)
        fsync_tree(tmp)
        fault_point("before_commit", step)
        tag = final.name
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            old = self.dir / (tag + DELETING_SUFFIX)
            os.rename(final, old)
            shutil.rmtree(old)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        fault_point("before_latest", step)
        atomic_write(self.dir / LATEST_FILE, tag)
        fault_point("before_retention", step)
        self._retain()

    def wait(self) -> None:
        """Block until the save in flight (checkpoint.async) is on disk; CheckpointSaveError
        when the last save failed (every rank raises it). Nothing to do without one."""
        done = self.writer.wait()
        if done is not None:
            step, error = done
            raise save_failed(error, self.dir, step)

    def _rng_file(self, folder: Path) -> Path:
        return folder / RNG_DIR / f"rank_{self.rank:05d}.pt"

    def _retain(self) -> None:
        tags = complete_tags(self.dir)
        for tag in tags[: max(0, len(tags) - self.keep_last)]:
            self.discard(tag)

    def discard(self, tag: str) -> None:
        """Remove checkpoint `tag` (rank 0): renamed first, so a kill mid-way leaves no folder
        that looks complete."""
        doomed = self.dir / (tag + DELETING_SUFFIX)
        os.rename(self.dir / tag, doomed)
        fsync_dir(self.dir)
        shutil.rmtree(doomed, ignore_errors=True)

    def load(self, engine, tag: str, seed: int) -> dict[str, Any]:
        """Restore engine (model, optimizer, scheduler), this rank's RNG; return trainer state.

        A checkpoint written by another number of ranks is re-partitioned first when its
        optimizer state is partitioned (pretrain/train/reshard.py; rank 0 converts it once),
        and the random states are re-seeded from (`seed`, step, rank), with one warning."""
        self.wait()
        folder = self.dir / tag
        state = read_state(folder)
        # Ours before DeepSpeed's: a file that is refused stops the resume before anything
        # else is loaded (this check cannot vouch for DeepSpeed's pickles: docs/checkpoints.md,
        # "Trust").
        rng = self._read_rng(folder) if state.get("world_size") == self.world_size else None
        resharded = needs_universal(folder, self.world_size)
        load_dir, load_tag = str(self.dir), tag
        if resharded:
            self._convert(folder)
            load_dir, load_tag = load_location(folder)
        with universal_loading(engine, resharded):
            path, _ = engine.load_checkpoint(
                load_dir, tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder}")
        if rng is not None:
            set_rng_state(rng)
        else:
            reseed(seed, state["step"], self.rank)
            if self.rank == 0:
                print(
                    f"warning: {folder} was written by {_ranks(state.get('world_size'))}, this "
                    f"run has {self.world_size}; random states (dropout) re-seeded from "
                    f"(train.seed, step, rank); data order is unaffected",
                    flush=True,
                )
        return state

    def _read_rng(self, folder: Path) -> dict[str, Any] | None:
        """This rank's saved RNG states (None without a file), read without running code;
        when any rank's file is refused, every rank raises its RngStateError (none waits
        alone in a collective)."""
        rng_file = self._rng_file(folder)
        rng, error = None, None
        if rng_file.is_file():
            try:
                rng = read_rng_state(rng_file, warn=self.rank == 0)
            except RngStateError as e:
                error = str(e)
        errors = [e for e in _gather([error]) if e]
        if errors:
            raise RngStateError(errors[0])
        return rng

    def _convert(self, folder: Path) -> None:
        """Rank 0 makes folder's universal form; every rank gets its error, if any."""
        error = None
        if self.rank == 0:
            saved = saved_ranks(folder)
            try:
                seconds = convert_to_universal(folder, verify=self.verify)
            except ReshardError as e:
                error = str(e)
            else:
                how = f"converted in {seconds:.1f} s" if seconds else "converted before"
                print(
                    f"re-partitioning {folder.name} (written by {_ranks(saved)}) for "
                    f"{self.world_size}: DeepSpeed universal checkpoint, {how}",
                    flush=True,
                )
        errors = [e for e in _gather([error]) if e]
        if errors:
            raise ReshardError(errors[0])


def _ranks(n: int | None) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"


def check_init_from(spec: str | None) -> None:
    """checkpoint.init_from takes a run (its newest checkpoint), RUN@STEP, a checkpoint folder
    or a weights folder (model.safetensors + config.yaml, as every checkpoint holds and
    tools/import_hf.py writes); any other folder is refused in one line saying what to give.
    The source's shape and integrity are checked next (weights.py, init_from_source)."""
    if not spec:
        return
    folder = Path(parse_init_from(spec)[0])
    if not folder.is_dir():
        return  # init_from_source names a missing path
    weights = (folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file()
    run = (folder / CHECKPOINTS_DIR).is_dir() or (folder / LATEST_FILE).is_file()
    if weights or run or any(folder.glob("step_*")):
        return
    where = f"checkpoint.init_from={spec!r}: {folder}"
    if (folder / "config.json").is_file():
        raise WeightsError(
            f"{where} is a Hugging Face folder (config.json), not a weights folder; convert "
            f"it first: python tools/import_hf.py --hf {folder} --out WEIGHTS, then "
            f"checkpoint.init_from=WEIGHTS"
        )
    raise WeightsError(
        f"{where} is neither a run's checkpoint (RUN, RUN@STEP, RUN/checkpoints/step_N) nor a "
        f"weights folder ({WEIGHTS_FILE} + {CONFIG_FILE}); give one of those"
    )


def save_failed(e: Exception | str, ckpt_dir: Path, step: int) -> CheckpointSaveError:
    """The error of a save that failed (disk full, quota, I/O): what failed (an exception, or
    its text from the save protocol), that the previous checkpoint is intact, and how to
    resume. A CheckpointSaveError (the protocol's, raised at a wait) is returned as is."""
    if isinstance(e, CheckpointSaveError):
        return e
    previous = find_resume_tag(ckpt_dir, "none")
    what = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return CheckpointSaveError(
        f"saving checkpoint {step_tag(step)} failed ({what}); "
        + (f"the previous checkpoint {previous} is intact: " if previous else "")
        + "free space (or fix the file system) and run the same command to resume"
    )
