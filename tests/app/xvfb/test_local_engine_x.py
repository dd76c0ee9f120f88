"""The window's own engine killed with `kill -9` and restarted from the status bar's button,
clicked through the X server (issue 23, items 5 and 10): DEAD names the signal and stays,
Send is disabled with the reason, Restart brings the engine back with the settings last
applied, and the window keeps its geometry."""
from __future__ import annotations

import os
import signal

from PySide6.QtCore import QPoint, QSettings

from kvscope.app.main import STYLE
from kvscope.app.main_window import MainWindow
from kvscope.testing.tiny_models import save_tiny_model
from tests.app.xvfb import xserver

TITLE = "kvscope-local-engine-x-test"


def click_widget(wid: str, window, widget) -> None:
    centre = widget.mapTo(window, QPoint(widget.width() // 2, widget.height() // 2))
    xserver.click(wid, centre.x(), centre.y())


def test_kill_9_then_restart_button_brings_back_the_applied_settings(qtbot, qapp, tmp_path,
                                                                      x_server):
    qapp.setStyleSheet(STYLE.read_text())
    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    w = MainWindow(engine_args=["--model", str(model), "--device", "cpu", "--block-size", "4",
                                "--kv-cache-bytes", "524288"],
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    w.setWindowTitle(TITLE)
    qtbot.addWidget(w)
    try:
        w.show()
        qtbot.waitExposed(w)
        w.start()
        qtbot.waitUntil(lambda: w.controls.config is not None, timeout=120_000)
        (wid, *_) = xserver.window_ids(title=f"^{TITLE}$")
        w.side_dock.raise_()
        w.side_tabs.setCurrentIndex(0)  # the Engine tab
        w.controls.block_size.setCurrentText("8")
        qtbot.wait(100)
        click_widget(wid, w, w.controls.apply_button)
        qtbot.waitUntil(lambda: w.controls.config.block_size == 8, timeout=60_000)
        geometry = w.frameGeometry()

        pid = w.engine.pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # as `kill -9` from a terminal
        qtbot.waitUntil(lambda: w.status.state == "dead", timeout=20_000)
        qtbot.wait(2500)  # past a heartbeat timeout: the real reason is still the one shown
        assert "SIGKILL" in w.status.engine_label.text()
        assert w.status.state_label.text().endswith("DEAD")
        assert not w.chat.send_button.isEnabled()
        assert "SIGKILL" in w.chat.send_button.toolTip()
        restart = w.status.restart_button
        assert restart.isVisible() and restart.text() == "Restart engine"

        click_widget(wid, w, restart)
        qtbot.waitUntil(lambda: w.status.state != "dead" and w.controls.config is not None,
                        timeout=120_000)
        assert w.engine.pid() not in (None, pid)
        assert w.controls.config.block_size == 8  # the applied setting, not the startup 4
        assert "restarted engine runs" in w.controls.result.text()
        qtbot.waitUntil(w.chat.send_button.isEnabled, timeout=10_000)
        qtbot.wait(300)  # a resize the restart caused would have reached the X server by now
        assert w.frameGeometry() == geometry
    finally:
        w.shutdown()
        qapp.setStyleSheet("")
