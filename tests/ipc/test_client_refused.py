"""EngineClient against an engine that refuses its handshake: a clear EngineDead within the
heartbeat timeout, never a hang (also when the refusal came before the first command)."""
from __future__ import annotations

import time

import pytest

from kvscope.ipc import EngineClient, EngineDead, keys
from tests.support.curve_stub import CurveHeartbeats


@pytest.fixture
def stub(tmp_path):
    folder = tmp_path / "engine-keys"
    keys.init_keys(folder)
    server = CurveHeartbeats(folder)
    yield server, folder
    server.close()


@pytest.mark.parametrize("who", ["plain", "unknown key"])
def test_commands_after_a_refused_handshake_fail_fast_and_close_cleanly(stub, tmp_path, who):
    server, folder = stub
    stranger = tmp_path / "stranger"
    keys.init_keys(stranger)
    own = keys.load_client_keys(stranger)
    client_keys = None if who == "plain" else keys.ClientKeys(
        own.public, own.secret, keys.load_server_keys(folder).public)
    client = EngineClient(*server.endpoints, timeout=60, heartbeat_timeout=1.0,
                          keys=client_keys)
    try:
        deadline = time.monotonic() + 30
        while client._refusal is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the refusal comes first: the DEALER then has no pipe to send on
        assert client._refusal is not None
        started = time.monotonic()
        for _ in range(3):  # several commands queued behind the refusal
            with pytest.raises(EngineDead, match="not authorized or not reachable"):
                client.hello()
        assert time.monotonic() - started < 30  # not the 60 s call timeout
    finally:
        started = time.monotonic()
        client.close()
        assert time.monotonic() - started < 10
