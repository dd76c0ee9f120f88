"""The real-X test group: its own Xvfb (1920x1080) for the session, DISPLAY pointed at it and
Qt on the xcb platform; every test is skipped, by name, where Xvfb or the xcb plugin's
libraries are missing. Run on its own: `QT_QPA_PLATFORM=xcb pytest tests/app/xvfb` (a
process's QApplication keeps the platform it started with)."""
from __future__ import annotations

import os

import pytest

from tests.app.xvfb import xserver

REASON = xserver.why_not_runnable()
_skipped: list[str] = []

if REASON is None:
    os.environ["QT_QPA_PLATFORM"] = "xcb"  # before pytest-qt makes the QApplication


def _platform_problem() -> str | None:
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    if app is not None and app.platformName() != "xcb":
        return (f"the QApplication already runs on {app.platformName()!r}; run this folder "
                "on its own with QT_QPA_PLATFORM=xcb")
    return None


def pytest_collection_modifyitems(config, items) -> None:
    reason = REASON or _platform_problem()
    if reason is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.skip(reason=f"real-X test skipped: {reason}"))
            _skipped.append(item.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if _skipped:
        terminalreporter.section("real-X tests skipped")
        terminalreporter.line(f"reason: {REASON or _platform_problem()}")
        for name in _skipped:
            terminalreporter.line(f"SKIPPED {name}")


@pytest.fixture(scope="session", autouse=True)
def x_server():
    """The session's X server; DISPLAY points at it until the last test is done."""
    if REASON is not None:
        yield None
        return
    server = xserver.start_xvfb(1920, 1080)
    before = os.environ.get("DISPLAY")
    os.environ["DISPLAY"] = server.display
    try:
        yield server
    finally:
        xserver.stop_process(server.process)
        if before is None:
            os.environ.pop("DISPLAY", None)
        else:
            os.environ["DISPLAY"] = before
