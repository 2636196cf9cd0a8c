"""The suite's time budget (tests/suite_budget.py): a test over the limit fails unless it is
marked slow with a reason; the run ends with the time per file; two workers run each file,
and the Slurm files together, whole on one worker."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


def test_a_slow_test_fails_unless_marked_slow_with_a_reason(pytester):
    pytester.makeini("[pytest]\nslow_limit_s = 0.2\nmarkers =\n    slow(reason): slow\n")
    pytester.makepyfile(
        test_timed="""
        import time
        import pytest

        def test_fast():
            pass

        def test_slow_unmarked():
            time.sleep(0.3)

        @pytest.mark.slow(reason="trains a model")
        def test_slow_marked():
            time.sleep(0.3)

        @pytest.mark.slow
        def test_slow_marked_without_reason():
            time.sleep(0.3)
        """
    )
    result = pytester.runpytest("-p", "suite_budget")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "test_slow_unmarked took 0.3 s (its own setup and call), over the 0.2 s" in out
    assert "test_slow_marked_without_reason took" in out
    assert "test_slow_marked took" not in out
    assert "time per test file" in out and "test_timed.py" in out


def test_a_shared_fixture_is_held_to_the_limit_on_its_own_not_charged_to_one_test(pytester):
    """A module fixture under the limit is not added to the first test that needs it (the
    export test's children once failed that way); one over the limit fails, naming it."""
    pytester.makeini("[pytest]\nslow_limit_s = 0.5\nmarkers =\n    slow(reason): slow\n")
    pytester.makepyfile(
        test_shared="""
        import time
        import pytest

        @pytest.fixture(scope="module")
        def built():
            time.sleep(0.4)

        @pytest.fixture(scope="module")
        def huge():
            time.sleep(0.6)

        def test_first_user(built):
            time.sleep(0.2)  # 0.6 s with the fixture's setup: its own 0.2 s is what counts

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
