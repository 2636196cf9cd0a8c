"""The suite's time is a budget (docs/reproducibility.md, "The suite's time"): `make test`
within 10 minutes on CI's 2 cores, `make test-quick` within 2. A pytest plugin (conftest.py
loads it):

- a test whose setup and call take over `slow_limit_s` (pyproject.toml, 60 s) fails unless
  it is marked `@pytest.mark.slow(reason="...")` saying why it costs that much, so the budget
  cannot erode one test at a time. A fixture of module or session scope is shared by the tests
  that use it, so its setup is not charged to the first test that happens to need it: it is
  held to the same limit on its own (a shared fixture over it fails that first test, naming the
  fixture), since every test of its file pays for it;
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

import time
from pathlib import Path

import pytest

_SETUP_SECONDS = pytest.StashKey[float]()
_SHARED_SECONDS = pytest.StashKey[dict]()  # fixture name -> seconds its (shared) setup took
_current: list = []  # the item being set up, for pytest_fixture_setup


def pytest_addoption(parser) -> None:
    parser.addini(
        "slow_limit_s",
        "seconds of setup + call over which a test must be marked slow(reason=...)",
        default="60",
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
    try:
        yield
    finally:
        _current.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    yield
    if fixturedef.scope != "function" and _current:
        shared = _current[-1].stash.setdefault(_SHARED_SECONDS, {})
        shared[fixturedef.argname] = time.perf_counter() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_SETUP_SECONDS] = call.duration
    if call.when != "call" or not report.passed:
        return
    limit = float(item.config.getini("slow_limit_s"))
    shared = item.stash.get(_SHARED_SECONDS, {})
    # The setup phase includes the shared fixtures it set up: count each second once.
    own = max(0.0, item.stash.get(_SETUP_SECONDS, 0.0) - sum(shared.values())) + call.duration
    over = {name: s for name, s in shared.items() if s > limit}
    if slow_reason(item) or (own <= limit and not over):
        return
    report.outcome = "failed"
    what = (
        f"{item.nodeid} took {own:.1f} s (its own setup and call)"
        if own > limit
        else f"the shared fixture {next(iter(over))!r} (first set up for {item.nodeid}) took "
        f"{max(over.values()):.1f} s"
    )
    report.longrepr = (
        f"{what}, over the {limit:g} s a test may take (slow_limit_s): make it cheaper "
        f'(docs/reproducibility.md, "The suite\'s time"), or mark the test '
        f'@pytest.mark.slow(reason="...") saying why it costs that much'
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
