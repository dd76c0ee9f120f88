"""An attached window in a real X server while its `kvscope serve` is stopped and started
again (issue 23, items 3 and 4): the Engine tab is enabled again, Send comes back, and the
window's geometry, as the X server reports it, does not change."""
from __future__ import annotations

import socket

from PySide6.QtCore import QSettings

from kvscope.app.main import STYLE
from kvscope.app.main_window import MainWindow
from tests.support.server_harness import Server, save_chat_model

TITLE = "kvscope-reconnect-x-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_serve_is_reattached_without_a_resize(qtbot, qapp, tmp_path, x_server):
    qapp.setStyleSheet(STYLE.read_text())
    model = save_chat_model(tmp_path / "chat")
    where = ("--endpoint", f"tcp://127.0.0.1:{free_port()}",
             "--state-endpoint", f"tcp://127.0.0.1:{free_port()}")
    server = Server(model, tmp_path / "serve1.log", *where)
    w = MainWindow(attach=server.command, attach_state=server.state, heartbeat_timeout=1.5,
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    w.setWindowTitle(TITLE)
    qtbot.addWidget(w)
    try:
        w.show()
        qtbot.waitExposed(w)
        w.start()
        qtbot.waitUntil(lambda: w.hello is not None, timeout=60_000)
        w.side_dock.raise_()
        w.side_tabs.setCurrentIndex(0)  # the Engine tab
        qtbot.wait(200)
        geometry = w.frameGeometry()
        assert "attached to" in w.status.mode_label.text()
        assert w.status.restart_button.text() == "Reconnect"
        server.stop()
        qtbot.waitUntil(lambda: w.status.state == "dead", timeout=20_000)
        assert not w.controls.apply_button.isEnabled()
        assert not w.chat.send_button.isEnabled() and w.chat.send_button.toolTip()
        assert w.status.state_label.text().endswith("DEAD")
        first = w.hello
        server = Server(model, tmp_path / "serve2.log", *where)
        qtbot.waitUntil(lambda: w.hello is not first and w.controls.config is not None,
                        timeout=60_000)
        qtbot.wait(300)  # any resize the re-attach caused would reach the X server by now
        assert w.controls.apply_button.isEnabled() and w.controls.apply_button.isVisible()
        assert w.chat.send_button.isEnabled()
        assert w.frameGeometry() == geometry
        assert w.frameGeometry().right() < qapp.primaryScreen().geometry().width()
    finally:
        w.shutdown()
        server.stop()
        qapp.setStyleSheet("")
