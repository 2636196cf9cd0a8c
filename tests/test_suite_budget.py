"""The suite's time budget (tests/suite_budget.py): a test over the limit fails unless it is
marked slow with a reason; the run ends with the time per file."""

from __future__ import annotations

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
    assert "test_slow_unmarked took 0.3 s (setup and call), over the 0.2 s" in out
    assert "test_slow_marked_without_reason took" in out
    assert "test_slow_marked took" not in out
    assert "time per test file" in out and "test_timed.py" in out
