"""The hang watchdog: a heartbeat per rank, one verdict all ranks agree on, stacks, exit 124.

A rank that hangs (a dead NIC, a stuck collective, a deadlocked data worker) stops the whole
job: the other ranks wait for it inside a collective, and neither side can take part in
another one. So the watchdog works beside the training's collectives: a thread per rank,
talking through the process group's key-value store (c10d's TCPStore, hosted by rank 0's
process or by torchrun's agent), which a thread can use while its main thread is blocked.

    main thread       `beat(step)` when a step completes, `progress()` when a save or a
                      rollback ends (the HangWatchdog callback, first of the callbacks)
    every thread      every `poll` seconds: publishes this rank's heartbeat (a counter, its
                      last step, overdue or not, where its main thread is) under
                      watchdog/rank/K, and looks for the verdict
    rank 0's thread   once overdue itself, reads every rank's heartbeat; when every rank is
                      overdue, silent or finished, it writes the verdict: one line naming the
                      stalled step and the ranks that stopped (any rank judges when rank 0 is
                      silent; the store's compare-and-set keeps the first verdict)
    on the verdict    every thread writes RUN/hang/rank_K.txt (the stacks of all its
                      threads), counts itself done, waits (boundedly) for the others, and
                      ends the process with EXIT_HUNG

A rank is *overdue* when its main thread made no progress for `timeout` seconds, or for
`long_timeout` before the first step of this start completed (compile, data workers, the
first collectives) and while its main thread is inside a slow phase (`slow_phase`: the
trainer declares a checkpoint being written, loaded or waited for, and every evaluation). It is *silent* when its heartbeat has not changed for
`timeout` seconds (its process is gone or frozen). Asking every rank to be overdue gives a
rank that is legitimately busy (rank 0 writing the weights file while the others wait in a
barrier) its own allowance. A rank that cannot reach the store (the process hosting it is
gone) and is overdue acts alone: it writes its stacks and exits.

It exits EXIT_HUNG (124, pretrain/exit_codes.py, which says why that number);
slurm/launch.sh requeues it (PRETRAIN_MAX_HANG_REQUEUES times).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pretrain.exit_codes import EXIT_HUNG
from pretrain.run_layout import atomic_write

KEY = "pretrain/watchdog"


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (a job of 1000 ranks stays one line)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ", ".join(parts)


_phase: str | None = None  # the slow phase the main thread is in (slow_phase), or None


@contextlib.contextmanager
def slow_phase(what: str) -> Iterator[None]:
    """Declares that the main thread is doing something that may outlast train.hang_timeout
    (`what`: "a checkpoint", "an evaluation"): the watchdog allows train.hang_timeout_long
    while inside. Declared by the code that starts the work, so that where the time goes
    (a library, a collective, a data worker) cannot hide it."""
    global _phase
    previous, _phase = _phase, what
    try:
        yield
    finally:
        _phase = previous


def current_phase() -> str | None:
    return _phase


def main_thread_position(frame) -> dict[str, Any]:
    """Where a stack is: inside a torch.distributed collective (its name) or elsewhere (its
    innermost frame and source line); and the slow phase the main thread declared."""
    stack = traceback.extract_stack(frame)
    phase = current_phase()
    for s in reversed(stack):
        if "/torch/distributed/" in s.filename.replace(os.sep, "/") and s.name != "wrapper":
            return {"collective": s.name, "phase": phase, "where": f"in a collective ({s.name})"}
    s = stack[-1]
    short = short_path(s.filename)
    return {
        "collective": None,
        "phase": phase,
        "where": f"in {s.name} ({short}:{s.lineno}: {s.line})",
    }


def short_path(filename: str) -> str:
    """.../site-packages/torch/x.py -> torch/x.py; /repo/pretrain/faults.py -> pretrain/faults.py."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    if "pretrain" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("pretrain") :])
    return "/".join(parts[-2:])


def format_stacks() -> str:
    """Every thread's Python stack (the main thread first), most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    out = []
    for ident, frame in frames:
        label = " (main thread)" if ident == main else ""
        out.append(f"Thread {names.get(ident, ident)}{label}, most recent call last:")
        out.append("".join(traceback.format_stack(frame)).rstrip("\n"))
        out.append("")
    return "\n".join(out)


class Watchdog:
    """One rank's watchdog thread; see the module docstring.

    `store`: the process group's store (None: this rank alone). `report(rank)`: the path of
    a rank's stack file. `log`: one line to the console (the verdict). `exit_process`: how
    the process ends (os._exit: a hung main thread runs no clean-up)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        long_timeout: float,
        report: Callable[[int], Path],
        log: Callable[[str], None] = print,
        step: int = 0,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.long_timeout = timeout, long_timeout
        self.poll = min(5.0, max(0.1, timeout / 10))
        self.report, self.log, self.exit_process = report, log, exit_process
        self.step = step  # the last completed step
        self.last_progress = time.monotonic()
        self.started = False  # a step of this start completed
        self.count = 0  # heartbeats published
        self.verdict: str | None = None
        self.finished: str | None = None  # "done" or "failed" once the loop has ended
        self._stop = threading.Event()
        self._reported = threading.Event()  # the stack file is written
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it changed)
        self._store_ok = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name="pretrain-hang-watchdog", daemon=True
        )

    # ------------------------------------------------------------------ the main thread

    def start(self) -> None:
        self._thread.start()

    def beat(self, step: int) -> None:
        """A step completed (no lock: plain assignments, which the thread only reads)."""
        self.step, self.started, self.last_progress = step, True, time.monotonic()

    def progress(self) -> None:
        """A slow phase ended (a save, a rollback): the next step gets a whole allowance."""
        self.last_progress = time.monotonic()

    def close(self, failed: bool = False) -> None:
        """The run ends (`failed`: with an error). After a verdict, wait for the report and
        exit with EXIT_HUNG: a rank whose collective failed because a peer exited gets here
        with an error, and must not leave with 1. Otherwise stop the thread and tell the
        others this rank finished, or failed (their verdict then names it)."""
        if self.verdict is not None:
            self._reported.wait(timeout=self.exit_grace + 5.0)
            self.exit_process(EXIT_HUNG)
            return
        self.finished = "failed" if failed else "done"
        self._stop.set()
        self._thread.join(timeout=self.poll + 5.0)
        if self.verdict is not None:  # it came while stopping
            self.close()
            return
        with contextlib.suppress(Exception):  # the store's host may have finished already
            self._publish(self._status(time.monotonic()))

    # ------------------------------------------------------------------ the thread

    @property
    def exit_grace(self) -> float:
        """How long a reported rank waits for the others' reports before it exits."""
        return max(5.0, 5 * self.poll)

    def _status(self, now: float) -> dict[str, Any]:
        idle = now - self.last_progress
        position: dict[str, Any] = {"phase": None}
        if idle > self.timeout:  # only then does it matter where the main thread is
            frame = sys._current_frames().get(threading.main_thread().ident)
            position = main_thread_position(frame) if frame is not None else position
        slow = not self.started or position["phase"] is not None
        limit = self.long_timeout if slow else self.timeout
        return {
            "count": self.count,
            "step": self.step,
            "idle": round(idle, 2),
            "limit": limit,
            "overdue": idle > limit,
            "finished": self.finished,
            **position,
        }

    def _publish(self, status: dict[str, Any]) -> None:
        self.count += 1
        status["count"] = self.count
        self.store.set(f"{KEY}/rank/{self.rank}", json.dumps(status))

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            status = self._status(now)
            if self.store is None:
                if status["overdue"]:
                    self._trip(self._alone_verdict(status, "it runs alone"), judged=True)
                    return
                continue
            try:
                self._publish(status)
                verdict = self._read(f"{KEY}/verdict")
                if verdict is None and status["overdue"] and self._judging(now):
                    verdict = self._judge(now, status)
                self._store_ok = now
            except Exception:  # noqa: BLE001 (the store's host process is gone)
                if status["overdue"] and now - self._store_ok > self.timeout:
                    why = "the process group's store is unreachable (its host rank is gone?)"
                    self._trip(self._alone_verdict(status, why), judged=True)
                    return
                continue
            if verdict is not None:
                self._trip(verdict[0], judged=verdict[1])
                return

    def _read(self, key: str) -> tuple[str, bool] | None:
        return (self.store.get(key).decode(), False) if self.store.check([key]) else None

    def _heartbeat(self, rank: int) -> dict[str, Any] | None:
        key = f"{KEY}/rank/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _judging(self, now: float) -> bool:
        """Rank 0 judges; any rank does when rank 0's heartbeat is silent."""
        if self.rank == 0:
            return True
        return self._silent(0, self._heartbeat(0), now)

    def _silent(self, rank: int, beat: dict[str, Any] | None, now: float) -> bool:
        count = beat["count"] if beat else -1
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - seen[1] > self.timeout

    def _judge(self, now: float, own: dict[str, Any]) -> tuple[str, bool] | None:
        """The verdict, when every rank is overdue, silent or finished; else None."""
        beats = {r: own if r == self.rank else self._heartbeat(r) for r in range(self.world_size)}
        silent = [r for r, b in beats.items() if r != self.rank and self._silent(r, b, now)]
        finished = [r for r, b in beats.items() if b and b["finished"] and r not in silent]
        busy = [
            r
            for r, b in beats.items()
            if r not in silent and r not in finished and not (b and b["overdue"])
        ]
        if busy or len(finished) == self.world_size:
            return None
        line = self._verdict_line(beats, silent, finished, own)
        self.store.set(f"{KEY}/expected", str(self.world_size - len(silent) - len(finished)))
        stored = self.store.compare_set(f"{KEY}/verdict", "", line).decode()
        return stored, stored == line

    def _verdict_line(self, beats, silent, finished, own) -> str:
        live = {r: b for r, b in beats.items() if b and r not in silent and r not in finished}
        stalled = min((b["step"] for b in beats.values() if b), default=own["step"]) + 1
        stopped = {}  # where -> ranks, for ranks outside any collective
        waiting = {}  # collective -> ranks
        for r, b in sorted(live.items()):
            if b.get("collective"):
                waiting.setdefault(b["collective"], []).append(r)
            else:
                stopped.setdefault(b.get("where", "?"), []).append(r)
        parts = [
            f"hang: step {stalled} stalled, no step completed for {own['idle']:.1f} s "
            f"(train.hang_timeout {self.timeout:g} s, {self.long_timeout:g} s at start, "
            f"saves, evaluations)"
        ]
        for where, ranks in stopped.items():
            parts.append(f"rank {ranks_text(ranks)} stopped outside any collective, {where}")
        if silent:
            parts.append(
                f"rank {ranks_text(silent)} stopped answering (process gone or frozen; no stacks)"
            )
        for name, ranks in waiting.items():
            parts.append(f"rank {ranks_text(ranks)} waits in a collective ({name})")
        if not stopped and not silent:
            parts.append("no rank stopped outside a collective: a stuck collective or network")
        failed = [r for r in finished if beats[r]["finished"] == "failed"]
        if failed:
            parts.append(f"rank {ranks_text(failed)} ended with an error (see its log)")
        if len(failed) < len(finished):
            done = [r for r in finished if r not in failed]
            parts.append(f"rank {ranks_text(done)} finished")
        parts.append(f"stacks in {self.report(0).parent}/; exiting with {EXIT_HUNG}")
        return "; ".join(parts)

    def _alone_verdict(self, status: dict[str, Any], why: str) -> str:
        return (
            f"hang: step {status['step'] + 1} stalled on rank {self.rank}, no step completed "
            f"for {status['idle']:.1f} s (train.hang_timeout {self.timeout:g} s); {why}; "
            f"rank {self.rank} is {status.get('where', '?')}; stacks in "
            f"{self.report(self.rank)}; exiting with {EXIT_HUNG}"
        )

    def _trip(self, verdict: str, judged: bool) -> None:
        """Write this rank's stacks, wait for the others' (boundedly), exit EXIT_HUNG."""
        self.verdict = verdict
        if judged:
            self.log(verdict)
        try:
            self._write_report(verdict)
        finally:
            self._reported.set()
        if self.store is not None:
            self._wait_for_the_others()
        self.exit_process(EXIT_HUNG)

    def _write_report(self, verdict: str) -> None:
        status = self._status(time.monotonic())
        frame = sys._current_frames().get(threading.main_thread().ident)
        where = main_thread_position(frame)["where"] if frame is not None else "?"
        when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        path = self.report(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        head = (
            f"hang report of rank {self.rank} of {self.world_size} (host "
            f"{socket.gethostname()}, pid {os.getpid()}), {when}\n"
            f"verdict: {verdict}\n"
            f"this rank: last completed step {status['step']}, no progress for "
            f"{status['idle']:.1f} s (allowed {status['limit']:g} s); main thread {where}\n\n"
        )
        atomic_write(path, head + format_stacks())

    def _wait_for_the_others(self) -> None:
        """Nobody exits before every live rank has its report: a rank that exits breaks the
        others' collectives, and each must know the verdict by then to exit with EXIT_HUNG."""
        end = time.monotonic() + self.exit_grace
        try:
            self.store.add(f"{KEY}/done", 1)
            expected = self._read(f"{KEY}/expected")
            want = int(expected[0]) if expected else self.world_size
            while self.store.add(f"{KEY}/done", 0) < want and time.monotonic() < end:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 (the store's host exited first: all are done)
            pass


def default_store() -> Any:
    """The store of the default process group (None without one): the rendezvous TCPStore
    (under a prefix), reachable from any thread."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()
