"""`kvscope --attach` with CURVE keys: the window says "not authorized or not reachable" within
the heartbeat timeout when the engine refuses it, and never hangs."""
from __future__ import annotations

import time

import pytest
from PySide6.QtCore import QSettings

from kvscope.app.main import attach_keys, build_parser, run
from kvscope.ipc import EngineClient, keys
from tests.support.curve_stub import CurveHeartbeats


@pytest.fixture
def engine_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = keys.default_keys_dir()
    keys.init_keys(folder)
    return folder


def test_a_refused_window_says_so_within_the_heartbeat_timeout(qtbot, tmp_path, engine_keys):
    from kvscope.app.main_window import MainWindow

    stranger = tmp_path / "stranger"
    keys.init_keys(stranger)
    server = CurveHeartbeats(engine_keys)
    try:
        command, state = server.endpoints
        with EngineClient(command, state, heartbeat_timeout=1.5,
                          keys=keys.load_client_keys(engine_keys)) as allowed:
            allowed.subscribe(["heartbeat"])  # the stand-in is reachable for allowed keys
            assert allowed.wait_frame("heartbeat", timeout=20) is not None
        own = keys.load_client_keys(stranger)
        refused = keys.ClientKeys(own.public, own.secret,
                                  keys.load_server_keys(engine_keys).public)
        w = MainWindow(attach=command, attach_state=state, attach_keys=refused,
                       heartbeat_timeout=1.5,
                       settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
        qtbot.addWidget(w)
        try:
            started = time.monotonic()
            w.start()
            qtbot.waitUntil(lambda: w.status.state_label.property("state") == "dead",
                            timeout=20_000)
            assert "not authorized or not reachable" in w.status.engine_label.text()
            assert w.hello is None
            assert time.monotonic() - started < 20
        finally:
            w.shutdown()
    finally:
        server.close()


def test_attach_loads_keys_off_loopback_or_when_asked(engine_keys, capsys):
    parse = build_parser().parse_args
    assert attach_keys(parse(["--attach", "tcp://127.0.0.1:5570"])) is None
    on_loopback = attach_keys(parse(["--attach", "tcp://127.0.0.1:5570", "--auth", "curve"]))
    assert on_loopback.server_public == keys.read_public(engine_keys / "server.key")
    assert attach_keys(parse(["--attach", "tcp://10.1.2.3:5570"])) == on_loopback
    assert attach_keys(parse(["--attach", "tcp://10.1.2.3:5570", "--insecure"])) is None
    (engine_keys / "client.key_secret").unlink()
    assert run(parse(["--attach", "tcp://10.1.2.3:5570"])) == 2  # before any window opens
    err = capsys.readouterr().err
    assert "client.key_secret" in err and "kvscope keys init" in err
