"""Where a rank's step time goes: its parts, timed where the work runs, read at log steps only.

    PARTS          data (reading this rank's micro batches), forward, backward (DeepSpeed's
                   gradient reduction included where it runs inside backward: ZeRO-2,
                   overlap_comm), optimizer (the engine's step: clipping, the update, ZeRO-1's
                   reduce-scatter / all-gather), collective (the trainer's one all-reduce of
                   the step: mostly waiting for the slowest rank)
    PartTimer      `with timer.part("forward"):` on the host clock on a CPU; on a GPU a pair of
                   CUDA events per part and step, whose elapsed times are read only when
                   `take()` is called at a logging step (synchronizing on the last event): no
                   host read is added per step
    StragglerWatch names a rank whose own work (data + forward: what no other rank can hold
                   up, since a forward under ZeRO 0-2 has no collective) stays more than
                   `fraction` above the median of the ranks for `steps` logged steps in a row,
                   in one line, long before the hang watchdog would fire

A slow rank makes the others wait in the first collective after its slow part, so their
backward, optimizer or collective time grows too; the straggler is the rank whose own part
is slow, not the ones that wait (docs/hangs.md, "Stragglers").
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PARTS = ("data", "forward", "backward", "optimizer", "collective")
OWN = ("data", "forward")  # this rank's own work: no collective inside


class PartTimer:
    """Seconds per part since the last `take()`, on the host or on the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = dict.fromkeys(PARTS, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def part(self, name: str, host: bool = False) -> Iterator[None]:
        """Time the block as `name`; `host`: on the host clock wherever the work is (reading
        batches is the host's work)."""
        if self.cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((name, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.host[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """Each part's seconds since the last take (reading the device's events waits for the
        last of them), then starts over."""
        out = dict(self.host)
        if self.events:
            self.events[-1][2].synchronize()
            for name, start, end in self.events:
                out[name] += start.elapsed_time(end) / 1e3
        self.host = dict.fromkeys(PARTS, 0.0)
        self.events.clear()
        return out


@dataclass
class Straggler:
    rank: int
    host: str
    own: float  # its own seconds per step (data + forward)
    median: float  # the ranks' median of the same
    part: str  # its slowest part against the median
    part_seconds: float
    part_median: float
    steps: int  # logged steps in a row

    def line(self) -> str:
        return (
            f"straggler: rank {self.rank} on {self.host} has taken {self.own / self.median:.1f}x "
            f"the median rank's own time per step for {self.steps} logged steps in a row "
            f"({self.own:.3g} s against {self.median:.3g} s: data + forward, which no other rank "
            f"holds up); its slow part: {self.part} ({self.part_seconds:.3g} s against "
            f"{self.part_median:.3g} s)"
        )


class StragglerWatch:
    """Counts, per rank, the logged steps in a row its own time was more than `fraction`
    above the median (and `floor` seconds, so that microseconds of noise on a tiny model do
    not count); names it once when the count reaches `steps`, again only after it recovered."""

    def __init__(self, fraction: float, steps: int, hosts: list[str], floor: float = 1e-3):
        self.fraction, self.steps, self.hosts, self.floor = fraction, steps, hosts, floor
        self.runs = [0] * len(hosts)

    def update(self, parts: list[dict[str, float]]) -> list[Straggler]:
        """`parts`: every rank's seconds per step by part, for one logged step."""
        own = [sum(p[k] for k in OWN) for p in parts]
        median = statistics.median(own)
        named = []
        for rank, seconds in enumerate(own):
            slow = seconds > (1 + self.fraction) * median and seconds - median > self.floor
            self.runs[rank] = self.runs[rank] + 1 if slow else 0
            if self.runs[rank] == self.steps:
                medians = {k: statistics.median(p[k] for p in parts) for k in OWN}
                part = max(OWN, key=lambda k: parts[rank][k] - medians[k])
                named.append(
                    Straggler(
                        rank,
                        self.hosts[rank],
                        seconds,
                        median,
                        part,
                        parts[rank][part],
                        medians[part],
                        self.steps,
                    )
                )
        return named
