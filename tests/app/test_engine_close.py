"""What closing the window does to its engine: a local engine child the window started is shut
down cleanly (it exits 0, through `kvscope serve`'s own SIGTERM path); an engine the window
attached to is only detached from, never sent a shutdown, and keeps serving."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading
import time

import msgspec
import zmq
from PySide6.QtCore import QProcess, QSettings

from kvscope.app.main_window import MainWindow
from kvscope.ipc import EngineClient, codec
from kvscope.ipc import messages as m
from kvscope.testing.frames import engine_settings, heartbeat


class RecordingEngine(threading.Thread):
    """ROUTER + PUB: answers hello, says so for anything else, beats, and records each
    command's type."""

    def __init__(self) -> None:
        super().__init__(name="recording-engine", daemon=True)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        self.router.bind("tcp://127.0.0.1:0")
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoints = (self.router.getsockopt_string(zmq.LAST_ENDPOINT),
                          self.pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.commands: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        beats, next_beat = 0, 0.0
        try:
            while not self.stop.is_set():
                if self.router.poll(5):
                    who, payload = self.router.recv_multipart()
                    self.router.send_multipart([who, codec.encode(self._answer(payload))])
                if time.monotonic() >= next_beat:
                    beats += 1
                    self.pub.send_multipart([b"heartbeat", codec.encode(heartbeat(beats))])
                    next_beat = time.monotonic() + 0.1
        finally:
            self.router.close(0)
            self.pub.close(0)
            self.ctx.term()

    def _answer(self, payload: bytes):
        cmd = codec.decode_command(payload)
        self.commands.append(type(cmd).__name__)
        if not isinstance(cmd, m.Hello):
            return m.Error(cmd.id, m.INTERNAL, "this stand-in only says hello")
        hello = m.HelloResult(m.PROTOCOL_VERSION, "fake", "fake-model", 1, engine_settings(),
                              512, m.DEFAULT_MAX_MESSAGE_BYTES)
        return m.Ok(cmd.id, msgspec.Raw(codec.encode(hello)))


def settings(tmp_path) -> QSettings:
    return QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)


def test_closing_an_attached_window_leaves_the_engine_running(qtbot, tmp_path):
    engine = RecordingEngine()
    engine.start()
    try:
        w = MainWindow(attach=engine.endpoints[0], attach_state=engine.endpoints[1],
                       settings=settings(tmp_path))
        qtbot.addWidget(w)
        w.start()
        qtbot.waitUntil(lambda: w.hello is not None, timeout=20_000)
        w.close()  # as the user closes it
        assert w.closed and w.engine is None  # attached: no child of its own
        assert engine.commands == ["Hello"]  # never a Shutdown
        with EngineClient(*engine.endpoints, heartbeat_timeout=10) as other:
            assert other.hello(timeout=10).model == "fake-model"  # still serving
        assert engine.commands == ["Hello", "Hello"]
    finally:
        engine.stop.set()
        engine.join(10)


def test_closing_a_window_shuts_its_local_engine_down_cleanly(qtbot, tmp_path):
    from kvscope.testing.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    w = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                "--kv-cache-bytes", "262144"], settings=settings(tmp_path))
    qtbot.addWidget(w)
    w.start()
    qtbot.waitUntil(lambda: w.hello is not None, timeout=120_000)
    pid, exits = w.engine.pid(), []
    w.engine.proc.finished.connect(lambda code, status: exits.append((code, status)))
    w.close()
    assert exits == [(0, QProcess.ExitStatus.NormalExit)], w.engine.stderr_tail
    assert not w.engine.running and pid is not None
