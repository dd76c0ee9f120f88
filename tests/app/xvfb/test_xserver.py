"""The real-X group's own footing: Qt runs on xcb against this session's Xvfb, and xdotool
finds and resizes a Qt window there."""
from __future__ import annotations

import os

from PySide6.QtWidgets import QLabel

from tests.app.xvfb import xserver


def test_qt_runs_on_the_sessions_x_server(qapp, x_server):
    assert qapp.platformName() == "xcb"
    assert os.environ["DISPLAY"] == x_server.display
    screen = qapp.primaryScreen().geometry()
    assert (screen.width(), screen.height()) == (1920, 1080)


def test_xdotool_resizes_a_qt_window(qtbot, x_server):
    label = QLabel("resize me")
    label.setWindowTitle("kvscope-xdotool-probe")
    qtbot.addWidget(label)
    label.resize(300, 200)
    label.show()
    qtbot.waitExposed(label)
    wid = xserver.window_ids(title="kvscope-xdotool-probe")
    assert wid, "xdotool found no window with that title"
    xserver.window_size(wid[0], 640, 480)
    qtbot.waitUntil(lambda: (label.width(), label.height()) == (640, 480), timeout=5000)
    assert xserver.window_geometry(wid[0])[2:] == (640, 480)
