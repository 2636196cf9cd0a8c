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
