"""A real `kvscope serve` stopped and started again on the same port (issue 23, item 3): the
attached window asks hello again, its Engine tab is enabled again, its geometry unchanged."""
from __future__ import annotations

import os
import socket

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QSettings

from tests.support.server_harness import Server, save_chat_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_attached_window_comes_back_with_a_restarted_serve(qtbot, tmp_path):
    from kvscope.app.main_window import MainWindow

    model = save_chat_model(tmp_path / "chat")
    where = ("--endpoint", f"tcp://127.0.0.1:{free_port()}",
             "--state-endpoint", f"tcp://127.0.0.1:{free_port()}")
    server = Server(model, tmp_path / "serve1.log", *where)
    w = MainWindow(attach=server.command, attach_state=server.state, heartbeat_timeout=1.5,
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    try:
        w.show()
        w.start()
        qtbot.waitUntil(lambda: w.hello is not None, timeout=60_000)
        assert w.controls.apply_button.isEnabled()
        geometry = w.geometry()
        server.stop()
        qtbot.waitUntil(lambda: w.status.state == "dead", timeout=20_000)
        assert not w.controls.apply_button.isEnabled()
        assert not w.chat.send_button.isEnabled()
        first_hello = w.hello
        server = Server(model, tmp_path / "serve2.log", *where)
        qtbot.waitUntil(lambda: w.hello is not first_hello and w.controls.config is not None,
                        timeout=60_000)
        assert w.controls.apply_button.isEnabled()
        assert w.chat.send_button.isEnabled()
        assert w.status.state != "dead"
        assert w.geometry() == geometry
    finally:
        w.shutdown()
        server.stop()
