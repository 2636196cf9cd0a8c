"""Checkpoints that survive being killed at any moment, and auto-resume.

One checkpoint is a folder RUN/checkpoints/step_0001000/ (names: pretrain/run_layout.py) holding
    DeepSpeed's files            model, optimizer (ZeRO shards), LR scheduler
    rng/rank_00000.pt ...        python, numpy and torch RNG states of every rank
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
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
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
from pretrain.model.weights import weights_state
from pretrain.run_layout import (
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
from pretrain.train.async_save import (
    BackgroundSaves,
    HostCopy,
    capture_engine_saves,
    say,
    write_captured,
)
from pretrain.train.distributed import barrier
from pretrain.train.reshard import (
    ReshardError,
    convert_to_universal,
    load_location,
    needs_universal,
    saved_ranks,
    universal_loading,
)


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


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save/load through a DeepSpeed engine; rank 0 owns the folder operations.

    With checkpoint.async (`background`), `save` takes a host copy and returns while a thread
    writes it (pretrain/train/async_save.py); `wait()` blocks until it is on disk. Every
    save, load and rollback waits for the save in flight first; so do the end of a run
    and a pre-emption (callbacks/checkpointing.py).
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
        self.background = BackgroundSaves() if cfg.async_ else None
        barrier()

    def save(self, engine, step: int, state: dict[str, Any], write_weights) -> Path:
        """Write checkpoint `step`; `write_weights(folder, weights=None)` adds the weights
        folder's files (rank 0; `weights`: a host copy of `weights_state(engine.module)`).

        Every rank must call it. Returns the final folder (complete on return, or, in the
        background, once `wait()` returns).
        """
        self.wait()
        tag = step_tag(step)
        final = self.dir / tag
        tmp = self.dir / (tag + TMP_SUFFIX)
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        barrier()
        if self.background is not None:
            self._save_in_background(engine, step, state, write_weights, tmp, final)
            return final
        engine.save_checkpoint(str(self.dir), tag=tmp.name, client_state={}, save_latest=False)
        (tmp / RNG_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), self._rng_file(tmp))
        fault_point("after_engine_save", step)
        barrier()
        if self.rank == 0:
            write_weights(tmp)
            fault_point("after_weights", step)
        barrier()
        # Sizes and checksums of every file, the ranks sharing the reading.
        files = checkpoint_files(tmp)
        records = _gather(
            [(rel, file_record(tmp / rel)) for rel in _share(files, self.rank, self.world_size)]
        )
        if self.rank == 0:
            self._commit(step, state, dict(records), tmp, final)
            say(f"saved checkpoint {final}")
        barrier()
        return final

    def _save_in_background(self, engine, step, state, write_weights, tmp, final) -> None:
        """The save step's part (a host copy of everything), then the writer thread's."""
        t0 = time.perf_counter()
        host_copy = HostCopy(self.background.buffers)
        with capture_engine_saves(engine, host_copy) as captured:
            engine.save_checkpoint(str(self.dir), tag=tmp.name, client_state={}, save_latest=False)
        weights = host_copy(weights_state(engine.module, dtype=None)) if self.rank == 0 else None
        rng = rng_state()
        state = host_copy(state)  # callbacks' lists and dicts go on changing
        host_copy.seal()
        if self.rank == 0:
            say(
                f"writing checkpoint {final} in the background (copied in "
                f"{time.perf_counter() - t0:.2f} s)"
            )

        def write() -> str | None:
            error, records = None, []
            try:
                host_copy.wait()
                written = write_captured(captured)
                fault_point("async_write", step)
                (tmp / RNG_DIR).mkdir(parents=True, exist_ok=True)
                torch.save(rng, self._rng_file(tmp))
                written.append(str(self._rng_file(tmp)))
                fault_point("after_engine_save", step)
                if self.rank == 0:
                    write_weights(tmp, weights)
                    fault_point("after_weights", step)
                for path in written:  # this rank's files: durable, then checksummed
                    _fsync_file(path)
                    records.append((Path(path).relative_to(tmp).as_posix(), file_record(path)))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            return self._commit_when_all_written(step, state, tmp, final, error, records, t0)

        self.background.start(step, write)

    def _commit_when_all_written(self, step, state, tmp, final, error, records, t0) -> str | None:
        """(Writer thread, every rank.) When every rank's files are on disk, rank 0 commits.
        Returns the error of the save (the same on every rank), None when it is complete."""
        outcomes = self.background.gather((error, records))
        where = (lambda k: f" (rank {k})") if self.world_size > 1 else (lambda k: "")
        failed = [f"{err}{where(k)}" for k, (err, _) in enumerate(outcomes) if err]
        if failed:
            return failed[0]
        error = None
        if self.rank == 0:
            try:
                recorded = dict(rec for _, part in outcomes for rec in part)
                for rel in checkpoint_files(tmp):  # the weights folder's files
                    if rel not in recorded:
                        recorded[rel] = file_record(tmp / rel)
                self._commit(step, state, recorded, tmp, final)
                say(
                    f"saved checkpoint {final} (in the background: "
                    f"{time.perf_counter() - t0:.1f} s)"
                )
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        error = self.background.gather(error)[0]
        return f"{error}{where(0)}" if error else None

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
        when it failed (every rank raises it). Nothing to do without one."""
        done = self.background.wait() if self.background is not None else None
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
        rng_file = self._rng_file(folder)
        if rng_file.is_file() and state.get("world_size") == self.world_size:
            set_rng_state(torch.load(rng_file, weights_only=False))
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


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed python, numpy and torch from (seed, step, rank): a resume that cannot restore the
    saved states (another world size) neither repeats step 0's dropout nor shares a stream
    between ranks."""
    value = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def save_failed(e: Exception | str, ckpt_dir: Path, step: int) -> CheckpointSaveError:
    """The error of a save that failed (disk full, quota, I/O): what failed (an exception, or
    its text from a background save), that the previous checkpoint is intact, and how to
    resume. A CheckpointSaveError (a background save's, raised at a wait) is returned as is."""
    if isinstance(e, CheckpointSaveError):
        return e
    previous = find_resume_tag(ckpt_dir, "none")
    what = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return CheckpointSaveError(
        f"saving checkpoint {step_tag(step)} failed ({what}); "
        + (f"the previous checkpoint {previous} is intact: " if previous else "")
        + "free space (or fix the file system) and run the same command to resume"
    )
