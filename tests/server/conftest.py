"""The server tests: a client fixture on each test module's `server` (a real subprocess)."""
import pytest


@pytest.fixture
def client(server):
    """An EngineClient on the test module's `server` (a tests.support.server_harness.Server).
    Generous heartbeat timeout: other test processes share the CPUs."""
    from kvscope.ipc import EngineClient

    c = EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15)
    yield c
    c.close()
