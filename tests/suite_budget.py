"""The suite's time is a budget (docs/reproducibility.md, "The suite's time"): `make test`
within 10 minutes on CI's 2 cores, `make test-quick` within 2. A pytest plugin (conftest.py
loads it):

- a test whose setup and call cost more than `slow_limit_s` (60) seconds of CI's
  `slow_limit_cores` (2) cores, 120 CPU seconds (its process's, every thread, and its
  children's), fails unless it is marked
  `@pytest.mark.slow(reason="...")` saying why it costs that much, so the budget cannot erode
  one test at a time. CPU seconds, not wall seconds: a busy machine (a load of 7 on 2 cores)
  stretches a test's wall time 2-4x but not what it computes, and failed five sound tests
  when wall time was the measure. Under CI=true (CI's own, quiet machine) wall seconds are
  held to the same 120 too, so a test that waits rather than computes (a Slurm job, a
  timeout) cannot grow unseen: 120, not 60, since on CI's two workers a test that keeps both
  cores busy shares them with the other worker's test (the CPU-allocator plan test: 77 CPU
  seconds took 62 wall seconds on a quiet CI run). A fixture of module or session scope is shared by the tests that use it,
  so its setup is not charged to the first test that happens to need it: it is held to the
  same limit on its own (a shared fixture over it fails that first test, naming the fixture),
  since every test of its file pays for it; `PRETRAIN_SUITE_RECORD=FILE` writes every test's
  wall and CPU seconds (the figures the limit is checked against);
- the end of every run prints the seconds per test file, slowest first: the table in
  docs/reproducibility.md comes from CI's log;
- `make test` runs on two workers (pytest-xdist, `-n 2 --dist loadfile`), which this plugin
  schedules by work unit: a file's tests on one worker, in order, so that its module fixtures
  (a trained run, a batch of exports) are made once; the files that start the local Slurm
  cluster as one unit, first, so that one cluster runs at a time and its ~2 minutes of jobs
  are not the tail that one worker runs while the other waits. A test marked `slurm` in a
  file whose name does not say slurm is refused at collection.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_SETUP = pytest.StashKey[tuple]()  # (wall, cpu) seconds of the setup phase
_CALL = pytest.StashKey[tuple]()  # (wall, cpu) seconds of the call
_SHARED = pytest.StashKey[dict]()  # fixture name -> (wall, cpu) of its (shared) setup
_current: list = []  # the item being set up, for pytest_fixture_setup
# One line per test, `{"test", "wall", "cpu"}`, when set: the figures the limit was chosen by
# (docs/reproducibility.md, "The suite's time").
RECORD_ENV = "PRETRAIN_SUITE_RECORD"


def _child_cpu() -> dict[int, float]:
    """This process's children now, pid -> CPU seconds so far (theirs and their reaped
    children's), from /proc; {} where there is none."""
    me, tick, out = os.getpid(), os.sysconf("SC_CLK_TCK"), {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # ppid; then utime, stime, cutime, cstime at 11..14
            out[pid] = sum(int(x) for x in fields[11:15]) / tick
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its children that have ended: what
    a test costs, which a busy machine stretches in wall time but hardly in CPU time."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# Taken at import: a test that patches time.perf_counter (the metrics tests do) must not bend
# the clock its own budget is read from.
_perf_counter = time.perf_counter


def _clocks() -> tuple[float, float, dict[int, float]]:
    return _perf_counter(), cpu_seconds(), _child_cpu()


def _since(start: tuple[float, float, dict[int, float]]) -> tuple[float, float]:
    """(wall, CPU) seconds since `start`. A child of an earlier test that ended (a run killed
    and left to Python's subprocess module, which reaps it at the next Popen) adds its whole
    life's CPU to ours when it is reaped: what it had at `start` is taken back out."""
    wall, cpu, now = _clocks()
    earlier = sum(seconds for pid, seconds in start[2].items() if pid not in now)
    return wall - start[0], max(0.0, cpu - start[1] - earlier)


def pytest_addoption(parser) -> None:
    parser.addini(
        "slow_limit_s",
        "seconds of setup + call on CI's cores over which a test must be marked "
        "slow(reason=...): CPU seconds over this x slow_limit_cores (this process and its "
        "children); under CI=true wall seconds over this too",
        default="60",
    )
    parser.addini(
        "slow_limit_cores",
        "the cores the budget is for (CI's 2): a test may keep them all busy",
        default="2",
    )


def slow_reason(item) -> str:
    """The reason given by the item's `slow` mark ('' without a mark or a reason)."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return ""
    return str(mark.kwargs.get("reason") or (mark.args[0] if mark.args else ""))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _current.append(item)
    start = _clocks()
    try:
        yield
    finally:
        _current.pop()
        item.stash[_SETUP] = _since(start)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function" or not _current:
        yield
        return
    start = _clocks()
    yield
    if _current:
        _current[-1].stash.setdefault(_SHARED, {})[fixturedef.argname] = _since(start)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = _clocks()
    yield
    item.stash[_CALL] = _since(start)


def _over(item) -> str | None:
    """Why the test is over its budget, or None. CPU seconds always (a busy machine cannot
    fail a test); wall seconds too under CI=true, CI's own quiet machine, where a test that
    waits (a Slurm job, a timeout) rather than computes would otherwise grow unseen."""
    wall_limit = float(item.config.getini("slow_limit_s"))
    cores = float(item.config.getini("slow_limit_cores"))
    shared = item.stash.get(_SHARED, {})
    setup, call = item.stash.get(_SETUP, (0.0, 0.0)), item.stash.get(_CALL, (0.0, 0.0))
    # The setup phase includes the shared fixtures it set up: count each second once.
    own = [max(0.0, setup[i] - sum(s[i] for s in shared.values())) + call[i] for i in (0, 1)]
    clocks = [(1, "CPU seconds", wall_limit * cores)]
    if os.environ.get("CI") == "true":
        clocks.append((0, "wall seconds", wall_limit * cores))
    for i, unit, limit in clocks:
        if own[i] > limit:
            return (
                f"{item.nodeid} took {own[i]:.1f} {unit} (its own setup and call; "
                f"{own[0]:.1f} s wall, {own[1]:.1f} s CPU), over the {limit:g} {unit} a test may take"
            )
        for name, s in shared.items():
            if s[i] > limit:
                return (
                    f"the shared fixture {name!r} (first set up for {item.nodeid}) took "
                    f"{s[i]:.1f} {unit}, over the {limit:g} {unit} a test may take"
                )
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    record = os.environ.get(RECORD_ENV)
    if record:
        setup, run = item.stash.get(_SETUP, (0.0, 0.0)), item.stash.get(_CALL, (0.0, 0.0))
        line = {"test": item.nodeid, "wall": setup[0] + run[0], "cpu": setup[1] + run[1]}
        line["shared"] = {k: list(v) for k, v in item.stash.get(_SHARED, {}).items()}
        with open(record, "a") as f:
            f.write(json.dumps(line) + "\n")
    if not report.passed or slow_reason(item):
        return
    why = _over(item)
    if why is None:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{why} (slow_limit_s): make it cheaper (docs/reproducibility.md, \"The suite's "
        f'time"), or mark the test @pytest.mark.slow(reason="...") saying why it costs that much'
    )


def work_unit(nodeid: str) -> str:
    """What one worker runs together, in order: a file's tests; the Slurm files' as one."""
    path = nodeid.split("::", 1)[0]
    return "slurm" if "slurm" in Path(path).name else path


# xdist's own hook (optional: the GPU check's environment has no xdist). Not --dist loadgroup:
# pytest 9.2 keeps a node's id where xdist 3.8 cannot append the group, so it groups nothing.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the collection's order: the Slurm unit first
    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "slurm" in item.keywords and work_unit(item.nodeid) != "slurm":
            raise pytest.UsageError(
                f"{item.nodeid} starts the Slurm cluster: its file name must say slurm, so "
                "that two workers never run two clusters at once (tests/suite_budget.py)"
            )
    items.sort(key=lambda item: work_unit(item.nodeid) != "slurm")  # stable: files stay whole


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Seconds per test file (setup, call and teardown of its tests), slowest first."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown"):
                path = r.nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + r.duration
    if not per_file:
        return
    total = sum(per_file.values())
    terminalreporter.write_sep("=", f"time per test file ({total:.0f} s in tests)")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {path}")
