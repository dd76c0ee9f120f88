"""The edit-test loop's subset: `--quick` leaves out the tests that took a second or more.

Which tests are slow is measured, not guessed: `make durations` runs the whole suite with
`--record-durations tests/slow_tests.txt`, which writes every test whose setup + call +
teardown took at least SLOW_SECONDS on this machine. `make check` runs `pytest --quick`, which
deselects those and the `slow` (embedded model) tests. A test added since the last recording
runs in the quick subset until the next one; a test gone from the suite leaves a stale line.
A test whose setup alone took that long (a module fixture starting a server or loading a model)
lists its whole file: every test of the file pays that fixture when any of them runs.
Loaded as a plugin by tests/conftest.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

SLOW_SECONDS = 1.0
DEFAULT_LIST = "tests/slow_tests.txt"
HEADER = ("# Tests that took at least {:.0f} s (setup + call + teardown) in the last\n"
          "# `make durations`; `pytest --quick` (make check) leaves them out.\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvscope")
    group.addoption("--quick", action="store_true",
                    help="leave out the tests in the slow list and those marked slow")
    group.addoption("--slow-list", metavar="PATH", default=None,
                    help=f"the slow list --quick reads (default {DEFAULT_LIST})")
    group.addoption("--record-durations", metavar="PATH",
                    help=f"write the tests that took at least {SLOW_SECONDS:.0f} s to PATH")


def slow_list(config: pytest.Config) -> Path:
    given = config.getoption("--slow-list")
    return Path(given) if given else config.rootpath / DEFAULT_LIST


def read_slow(path: Path) -> set[str]:
    if not path.exists():
        return set()
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    slow = read_slow(slow_list(config))
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        heavy = (item.nodeid in slow or item.nodeid.split("::")[0] in slow
                 or item.get_closest_marker("slow") is not None)
        (drop if heavy else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class DurationRecorder:
    """Adds up each test's phases as their reports arrive (under xdist, on the controller)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}
        self.slow_setup_files: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when == "setup" and report.duration >= SLOW_SECONDS:
            self.slow_setup_files.add(report.nodeid.split("::")[0])

    def pytest_sessionfinish(self) -> None:
        slow = sorted({n for n, s in self.seconds.items() if s >= SLOW_SECONDS}
                      | self.slow_setup_files)
        self.path.write_text(HEADER.format(SLOW_SECONDS) + "".join(f"{n}\n" for n in slow))


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the xdist controller, or no xdist
        config.pluginmanager.register(DurationRecorder(Path(path)), "kvscope-durations")
