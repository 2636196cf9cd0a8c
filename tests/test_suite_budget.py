"""The suite's time budget (tests/suite_budget.py): a test over the limit of CPU seconds fails
unless it is marked slow with a reason, and a busy machine cannot fail one; the run ends with
the time per file; two workers run each file, and the Slurm files together, whole on one
worker."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# What the plugin measures: CPU seconds of work, a loop that computes (a sleep costs none).
BURN = """
import time

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
"""


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def test_a_slow_test_fails_unless_marked_slow_with_a_reason(pytester):
    pytester.makeini(
        "[pytest]\nslow_limit_cores = 1\nslow_limit_s = 0.2\nmarkers =\n    slow(reason): slow\n"
    )
    pytester.makepyfile(
        test_timed=BURN
        + """
import pytest

def test_fast():
    pass

def test_slow_unmarked():
    burn(0.3)

@pytest.mark.slow(reason="trains a model")
def test_slow_marked():
    burn(0.3)

@pytest.mark.slow
def test_slow_marked_without_reason():
    burn(0.3)
"""
    )
    result = pytester.runpytest("-p", "suite_budget")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "test_slow_unmarked took 0.3 CPU seconds (its own setup and call" in out
    assert "over the 0.2 CPU seconds a test may take (slow_limit_s)" in out
    assert "test_slow_marked_without_reason took" in out
    assert "test_slow_marked took" not in out
    assert "time per test file" in out and "test_timed.py" in out


def test_a_shared_fixture_is_held_to_the_limit_on_its_own_not_charged_to_one_test(pytester):
    """A module fixture under the limit is not added to the first test that needs it (the
    export test's children once failed that way); one over the limit fails, naming it."""
    pytester.makeini(
        "[pytest]\nslow_limit_cores = 1\nslow_limit_s = 0.5\nmarkers =\n    slow(reason): slow\n"
    )
    pytester.makepyfile(
        test_shared=BURN
        + """
import pytest

@pytest.fixture(scope="module")
def built():
    burn(0.4)

@pytest.fixture(scope="module")
def huge():
    burn(0.6)

def test_first_user(built):
    burn(0.2)  # 0.6 s with the fixture's setup: its own 0.2 s is what counts

def test_second_user(built):
    pass

def test_uses_huge(huge):
    pass

def test_also_uses_huge(huge):
    pass
"""
    )
    result = pytester.runpytest("-p", "suite_budget")
    result.assert_outcomes(passed=3, failed=1)
    out = result.stdout.str()
    assert "the shared fixture 'huge' (first set up for test_shared.py::test_uses_huge)" in out
    assert "FAILED test_shared.py::test_uses_huge" in out and "test_first_user -" not in out


def test_a_busy_machine_fails_no_test_but_a_costly_test_still_fails(pytester, monkeypatch):
    """Two processes spinning on this machine's cores (a load beyond what the suite makes by
    itself) stretch a 0.4 CPU-second test's wall time; the budget of 0.6 holds it all the same,
    and a 0.8 CPU-second test fails beside it. A test that waits (sleeps) past the limit costs
    no CPU: it passes, but not under CI=true, where wall seconds are held to the limit too."""
    monkeypatch.delenv("CI", raising=False)
    pytester.makeini(
        "[pytest]\nslow_limit_cores = 1\nslow_limit_s = 0.6\nmarkers =\n    slow(reason): slow\n"
    )
    pytester.makepyfile(
        test_load=BURN
        + """
import time

def test_within(): burn(0.4)
def test_costly(): burn(0.8)
def test_waits(): time.sleep(0.8)
"""
    )
    stop = multiprocessing.Event()
    spinners = [
        multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 2)
    ]
    for p in spinners:
        p.start()
    try:
        result = pytester.runpytest("-p", "suite_budget")
    finally:
        stop.set()
        for p in spinners:
            p.join()
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED test_load.py::test_costly" in result.stdout.str()
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest("-p", "suite_budget", "-k", "waits or within")
    result.assert_outcomes(passed=1, failed=1)
    assert "test_waits took 0.8 wall seconds" in result.stdout.str()


def test_a_child_left_by_an_earlier_test_is_not_charged_when_it_is_reaped(pytester):
    """A run an earlier test started and left (killed, or ended, not waited for) is reaped by
    Python at the next Popen, and the kernel then adds its whole CPU to ours: the guard takes
    back what it had before the test began (CI's loaded run once charged a 0.4 s test 70 s)."""
    pytester.makeini(
        "[pytest]\nslow_limit_cores = 1\nslow_limit_s = 0.3\nmarkers =\n    slow(reason): slow\n"
    )
    pytester.makepyfile(
        test_left="""
import os, sys, time, pytest

BURN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"

@pytest.mark.slow(reason="starts the child that the next test must not pay for")
def test_leaves_a_child():
    global pid
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", BURN], dict(os.environ))
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)  # it ended; nobody has waited for it

def test_reaps_it():
    assert os.waitpid(pid, 0)[0] == pid  # as subprocess does for a Popen dropped running
"""
    )
    result = pytester.runpytest("-p", "suite_budget")
    result.assert_outcomes(passed=2)


def test_the_record_holds_every_tests_wall_and_cpu_seconds(pytester, monkeypatch):
    record = pytester.path / "times.jsonl"
    monkeypatch.setenv("PRETRAIN_SUITE_RECORD", str(record))
    pytester.makepyfile(
        test_rec=BURN + "\nimport time\ndef test_a(): burn(0.2)\ndef test_b(): time.sleep(0.2)\n"
    )
    pytester.runpytest("-p", "suite_budget").assert_outcomes(passed=2)
    import json

    rows = {r["test"].split("::")[1]: r for r in map(json.loads, record.read_text().splitlines())}
    assert rows["test_a"]["cpu"] >= 0.2 and rows["test_b"]["cpu"] < 0.1
    assert rows["test_b"]["wall"] >= 0.2


def test_a_slurm_test_in_a_file_whose_name_does_not_say_slurm_is_refused(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slurm: starts the cluster\n")
    pytester.makepyfile(
        test_cluster="""
        import pytest

        @pytest.mark.slurm
        def test_job():
            pass
        """
    )
    result = pytester.runpytest("-p", "suite_budget")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test_cluster.py::test_job starts the Slurm cluster" in result.stderr.str()


def test_two_workers_run_each_file_and_the_slurm_files_whole_on_one_worker(pytester, monkeypatch):
    # Each test writes its worker and name; the files' order on disk puts the Slurm ones apart.
    log = pytester.path / "ran.txt"
    body = "import os\n" + "".join(
        f"def test_{i}():\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        f"        f.write(os.environ['PYTEST_XDIST_WORKER'] + ' ' + __name__ + ' {i}\\n')\n"
        for i in range(4)
    )
    names = ["test_a", "test_b_slurm", "test_c", "test_d", "test_e_slurm", "test_f"]
    pytester.makepyfile(**dict.fromkeys(names, body))
    # The workers load the plugin as the suite's conftest does.
    pytester.makeconftest(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "pytest_plugins = ['suite_budget']\n"
    )
    result = pytester.runpytest("-n", "2", "--dist", "loadfile")
    result.assert_outcomes(passed=24)
    ran = [line.split() for line in log.read_text().splitlines()]
    workers: dict[str, list[str]] = {}
    for worker, module, _ in ran:
        workers.setdefault(worker, []).append(module)
    assert len(workers) == 2
    for name in names:
        assert len({w for w, m, _ in ran if m == name}) == 1, name  # one worker per file
    slurm_worker = next(w for w, m, _ in ran if m == "test_b_slurm")
    # The Slurm unit first on its worker, whole: both files' tests, in the collection's order.
    assert workers[slurm_worker][:8] == ["test_b_slurm"] * 4 + ["test_e_slurm"] * 4
    for module in names:
        assert [i for _, m, i in ran if m == module] == ["0", "1", "2", "3"], module
