"""The quick subset (tests/support/durations.py): recorded durations choose what --quick drops."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SAMPLE = """
import time
import pytest

def test_fast():
    pass

def test_slow():
    time.sleep(1.05)

@pytest.mark.slow
def test_marked():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\nmarkers = slow: heavy\n")
    pytester.makepyfile(test_sample=SAMPLE)
    return pytester


def test_recording_lists_only_the_tests_over_a_second(suite: pytest.Pytester):
    out = suite.path / "slow.txt"
    result = suite.runpytest("-p", "tests.support.durations", "--record-durations", str(out))
    result.assert_outcomes(passed=3)
    listed = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    assert listed == ["test_sample.py::test_slow"]


def test_quick_leaves_out_the_listed_and_the_marked_tests(suite: pytest.Pytester):
    (suite.path / "slow.txt").write_text("# header\ntest_sample.py::test_slow\n")
    result = suite.runpytest("-p", "tests.support.durations", "--quick",
                             "--slow-list", str(suite.path / "slow.txt"))
    result.assert_outcomes(passed=1, deselected=2)


FIXTURE = """
import time
import pytest

@pytest.fixture(scope="module")
def server():
    time.sleep(1.05)

def test_first(server):
    pass

def test_second(server):
    pass
"""


def test_a_slow_module_fixture_lists_its_whole_file(pytester: pytest.Pytester):
    pytester.makepyfile(test_served=FIXTURE, test_plain="def test_alone():\n    pass\n")
    out = pytester.path / "slow.txt"
    pytester.runpytest("-p", "tests.support.durations", "--record-durations", str(out))
    listed = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    assert "test_served.py" in listed and "test_plain.py::test_alone" not in listed
    result = pytester.runpytest("-p", "tests.support.durations", "--quick", "--slow-list",
                                str(out))
    result.assert_outcomes(passed=1, deselected=2)


def test_without_quick_everything_runs(suite: pytest.Pytester):
    (suite.path / "slow.txt").write_text("test_sample.py::test_slow\n")
    result = suite.runpytest("-p", "tests.support.durations",
                             "--slow-list", str(suite.path / "slow.txt"))
    result.assert_outcomes(passed=3)
