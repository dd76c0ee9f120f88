"""The window's layout follows the window in a real X server (issue 23, items 4, 6, 7): a
live window resized through the window system from 1920x1080 down to 1280x720 and back
re-arranges its docks and never cuts the Engine tab, its Apply button or the status bar;
long status texts never widen it."""
from __future__ import annotations

import os

import pytest
from PySide6.QtCore import QRect, QSettings, Qt

from kvscope.app.main import STYLE
from kvscope.app.main_window import MainWindow, shown
from tests.app.xvfb import xserver
from tests.app.xvfb.layout_checks import clipped_labels, layout_problems, within_window

TITLE = "kvscope-layout-x-test"


@pytest.fixture
def live_window(qtbot, qapp, tmp_path, x_server):
    qapp.setStyleSheet(STYLE.read_text())  # the real fonts and margins
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    window = MainWindow(attach="tcp://127.0.0.1:9", settings=settings)
    window.setWindowTitle(TITLE)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    ids = xserver.window_ids(title=f"^{TITLE}$")
    assert ids, "xdotool cannot find the window"
    yield window, ids[0]
    window.shutdown()
    qapp.setStyleSheet("")


def resize_through_x(qtbot, qapp, window, wid: str, width: int, height: int) -> None:
    xserver.window_move(wid, 0, 0)  # as a person makes room for a larger window
    xserver.window_size(wid, width, height)
    qtbot.waitUntil(lambda: (window.width(), window.height()) == (width, height), timeout=5000)
    for _ in range(5):  # let the docks' and splitters' layouts settle
        qapp.processEvents()
        qtbot.wait(20)


def show_engine_tab(window) -> None:
    window.side_dock.raise_()
    window.side_tabs.setCurrentIndex(0)


def screen_rect(qapp):
    return qapp.primaryScreen().availableGeometry()


def test_opens_within_the_screen(live_window, qapp):
    window, wid = live_window
    free = screen_rect(qapp)
    assert free.contains(window.frameGeometry())
    assert free.contains(xserver_geometry(wid))


def xserver_geometry(wid: str) -> QRect:
    return QRect(*xserver.window_geometry(wid))


STEPS = [((1920, 1080), "three"), ((1366, 768), "two"), ((1280, 720), "two"),
         ((1920, 1080), "three")]


def test_resizing_rearranges_and_cuts_nothing(live_window, qtbot, qapp):
    window, wid = live_window
    for (width, height), arrangement in STEPS:
        resize_through_x(qtbot, qapp, window, wid, width, height)
        where = f"at {width}x{height}"
        assert window.arrangement == arrangement, where
        assert window.current_arrangement() == arrangement, where
        assert window.width() == width, f"{where}: the window widened itself"
        problems = layout_problems(window, screen_rect(qapp))
        assert not problems, (where, problems)
        show_engine_tab(window)
        qapp.processEvents()
        apply = window.controls.apply_button
        assert shown(window.side_dock) and shown(apply), f"{where}: Apply is not in view"
        assert within_window(window, apply), f"{where}: Apply sticks out of the window"
        clipped = clipped_labels(window.side_tabs.currentWidget())
        assert not clipped, (where, clipped)
        if arrangement == "two":
            window.chat_dock.raise_()
            qapp.processEvents()
            assert shown(window.chat), where


def test_hysteresis_keeps_the_arrangement_near_the_threshold(live_window, qtbot, qapp):
    window, wid = live_window
    resize_through_x(qtbot, qapp, window, wid, 1900, 1000)
    assert window.arrangement == "three"
    resize_through_x(qtbot, qapp, window, wid, 1800, 1000)  # between the two thresholds
    assert window.arrangement == "three"
    resize_through_x(qtbot, qapp, window, wid, 1700, 1000)
    assert window.arrangement == "two"
    resize_through_x(qtbot, qapp, window, wid, 1800, 1000)
    assert window.arrangement == "two"


def test_long_status_texts_never_widen_the_window(live_window, qtbot, qapp):
    window, wid = live_window
    resize_through_x(qtbot, qapp, window, wid, 1366, 768)
    window.status.mark_dead("the engine at tcp://127.0.0.1:5599 stopped answering; " * 12)
    window.controls.set_enabled(True)  # as a re-attach does
    for _ in range(5):
        qapp.processEvents()
        qtbot.wait(20)
    assert window.width() == 1366
    assert xserver.window_geometry(wid)[2] == 1366
    assert screen_rect(qapp).contains(window.frameGeometry())
    assert window.status.engine_label.toolTip().startswith("engine is dead")


def test_preemptions_and_interrupted_steps_fit_the_smallest_window(live_window, qtbot, qapp):
    from kvscope.testing.frames import stats_frame

    window, wid = live_window
    resize_through_x(qtbot, qapp, window, wid, 1280, 720)
    window.status.show_stats(stats_frame(preemptions_by_reason={"memory": 12, "priority": 345},
                                         interrupted_steps=6789))
    for _ in range(5):
        qapp.processEvents()
        qtbot.wait(20)
    label = window.status.preemptions_label
    assert label.isVisible() and label.text().endswith("6789 steps interrupted")
    assert window.width() == 1280 and xserver.window_geometry(wid)[2] == 1280
    assert not clipped_labels(window.status)
    shot = os.environ.get("KVSCOPE_STATUS_SHOT")
    if shot:
        assert window.grab().save(shot)


def test_reset_layout_restores_the_first_start(live_window, qtbot, qapp):
    window, wid = live_window
    resize_through_x(qtbot, qapp, window, wid, 1920, 1080)
    window.side_dock.setFloating(True)
    window.resizeDocks([window.chat_dock], [700], Qt.Orientation.Horizontal)
    window.reset_layout_action.trigger()
    for _ in range(5):
        qapp.processEvents()
        qtbot.wait(20)
    assert not window.side_dock.isFloating()
    assert window.arrangement == "three"
    assert not layout_problems(window, screen_rect(qapp))
    assert window.settings.value("window/state") is None
