"""State that survives and messages that tell the truth (issue 23, items 3, 5, 10): a revived
engine gets hello again, Restart uses the settings last applied, the Engine tab says "—"
while nothing is known, and the status bar keeps the real reason a local child died."""
import os
import signal

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QProcess, QSettings

from kvscope.app.bridge import death_kind, death_message
from kvscope.app.engine_process import exit_text
from kvscope.app.main_window import MainWindow
from kvscope.ipc import EngineClient
from kvscope.ipc import messages as m
from kvscope.testing.frames import engine_settings


def hello_with(**settings) -> m.HelloResult:
    return m.HelloResult(m.PROTOCOL_VERSION, "fake", "fake-model", 1,
                         engine_settings(**settings), 512, m.DEFAULT_MAX_MESSAGE_BYTES)


def window(qtbot, tmp_path, **kwargs) -> MainWindow:
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    w = MainWindow(settings=settings, **kwargs)
    qtbot.addWidget(w)
    return w


def test_a_revived_engine_gets_hello_again_and_the_controls_come_back(qtbot, qapp, tmp_path):
    w = window(qtbot, tmp_path, attach="tcp://127.0.0.1:9")
    w.show()
    qtbot.waitExposed(w)
    asked = []
    w.bridge.request_hello = lambda: (asked.append(1),
                                      w.bridge.helloReceived.emit(hello_with(block_size=32)))
    w.bridge.helloReceived.emit(hello_with())
    assert w.controls.apply_button.isEnabled()
    geometry = w.geometry()
    w.on_engine_dead("engine stopped answering: no heartbeat")
    assert not w.controls.apply_button.isEnabled()
    assert w.controls.block_size.currentText() == ""  # placeholder "—", no stale value
    assert not w.chat.send_button.isEnabled()
    w.bridge.engineRevived.emit()
    qapp.processEvents()
    assert asked == [1]
    assert w.controls.apply_button.isEnabled()
    assert w.controls.block_size.currentText() == "32"  # the revived engine's settings
    assert w.status.state != "dead"
    assert w.geometry() == geometry
    w.shutdown()


def test_the_engine_tab_shows_dashes_until_real_settings_arrive(qtbot, tmp_path):
    w = window(qtbot, tmp_path, attach="tcp://127.0.0.1:9")
    c = w.controls
    assert c.block_size.currentIndex() == -1 and c.block_size.placeholderText() == "—"
    for spin in (c.kv_budget, c.max_seqs, c.max_batched, c.kv_anchors):
        assert spin.text() == "—", spin  # not "1 MiB" or "1" that look real
    w.on_hello(hello_with(kv_cache_bytes=64 * 1024 * 1024, kv_anchor_tokens=0))
    assert c.kv_budget.text() == "64 MiB" and c.kv_anchors.text() == "0"
    assert c.kv_anchors.minimum() == 0  # the real range is back
    w.on_engine_dead("gone")
    assert c.kv_budget.text() == "—"
    w.shutdown()


def test_restart_uses_the_settings_last_applied(qtbot, tmp_path):
    w = window(qtbot, tmp_path, engine_args=["--model", "tiny"])
    started = []
    w.engine.start = lambda: started.append(list(w.engine.engine_args))
    w.on_hello(hello_with())
    w.on_reconfigured(engine_settings(block_size=32, kv_dtype="int8"))
    assert "Applied by the engine" in w.controls.result.text()
    w.restart_engine()
    args = started[-1]
    assert args[:2] == ["--model", "tiny"]
    last = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert last["--block-size"] == "32" and last["--kv-dtype"] == "int8"
    assert w.controls.result.text() == ""  # no "Applied" claim about the old child
    w.on_hello(hello_with(block_size=32, kv_dtype="int8"))
    assert w.controls.result.text().startswith("The restarted engine runs:")
    assert "block_size=32" in w.controls.result.text()
    w.shutdown()


def test_a_killed_child_is_named_by_its_signal_and_the_reason_stays(qtbot, tmp_path):
    assert exit_text(9, crashed=True) == "was killed by SIGKILL"
    assert exit_text(int(signal.SIGSEGV), crashed=True) == "was killed by SIGSEGV"
    assert exit_text(9, crashed=False) == "exited with code 9"
    w = window(qtbot, tmp_path, engine_args=[])
    w.engine.endpoints = ("tcp://a", "tcp://b")  # it had been ready
    w.engine._finished(9, QProcess.ExitStatus.CrashExit)
    assert "killed by SIGKILL" in w.status.engine_label.text()
    w.bridge.engineDied.emit("engine stopped answering: no heartbeat for 3.1 s")
    w.status.check_heartbeat()
    assert "killed by SIGKILL" in w.status.engine_label.text()  # not overwritten
    assert w.status.state == "dead" and w.status.restart_button.isVisibleTo(w.status)
    send = w.chat.send_button
    assert not send.isEnabled() and "SIGKILL" in send.toolTip()
    w.shutdown()


def test_the_status_bar_says_attached_or_local_and_reconnect(qtbot, tmp_path):
    w = window(qtbot, tmp_path, attach="tcp://127.0.0.1:5599")
    w.bridge.attach = lambda *a, **k: None
    w.start()
    assert "attached to tcp://127.0.0.1:5599" in w.status.mode_label.text()
    assert "no auth" in w.status.mode_label.text()
    assert w.status.restart_button.text() == "Reconnect"
    w.status.set_mode("tcp://h:1", curve=True)
    assert "CURVE auth on" in w.status.mode_label.text()
    w.shutdown()
    local = window(qtbot, tmp_path, engine_args=[])
    local.engine.start = lambda: None
    local.start()
    assert local.status.mode_label.text() == "local engine"
    assert local.status.restart_button.text() == "Restart engine"
    local.shutdown()


class Client:
    """What the bridge reads of an EngineClient; death_kind is the real client's own rule."""
    death_kind = EngineClient.death_kind

    def __init__(self, heard: bool, refusal: str | None, keys=None):
        self._heard, self._refusal, self.keys = heard, refusal, keys
        self.dead_reason = "not authorized or not reachable: ... `kvscope keys allow`"
        self.command_endpoint = "tcp://127.0.0.1:5599"


def test_unreachable_is_told_from_key_refused():
    assert death_kind(Client(False, None)) == "unreachable"
    assert death_message(Client(False, None)).startswith(
        "engine unreachable: nothing answered at tcp://127.0.0.1:5599")
    assert "keys allow" not in death_message(Client(False, None))  # not a key problem
    refused = Client(False, "it refused this client's public key")
    assert death_kind(refused) == "refused"
    assert death_message(refused).startswith("key refused: not authorized")
    assert death_message(Client(True, None)).startswith("engine stopped answering")


def test_the_rotation_note_does_not_move_apply(qtbot, qapp):
    from kvscope.app.controls.panel import ControlsPanel
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.resize(300, 600)
    panel.show_config(engine_settings(kv_dtype="float32", kv_rotation="none"))
    panel.show()
    qtbot.waitExposed(panel)
    qapp.processEvents()
    y = panel.apply_button.mapTo(panel, panel.apply_button.rect().topLeft()).y()
    panel.kv_dtype.setCurrentText("int8")  # a long, wrapping note
    qapp.processEvents()
    assert len(panel.rotation_note.text()) > 40
    assert panel.apply_button.mapTo(panel, panel.apply_button.rect().topLeft()).y() == y
