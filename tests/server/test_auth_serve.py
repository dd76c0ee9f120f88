"""A real `kvscope serve --auth curve`: who gets in, what garbage does, where traces may go."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import time

import pytest
import zmq

from kvscope.ipc import EngineClient, EngineDead, EngineError, keys
from kvscope.ipc.curve import secure_client_socket
from kvscope.ipc.endpoints import split_tcp
from kvscope.ipc.vllm_kv_subscriber import KVEventSubscriber
from tests.support.server_harness import Server, save_chat_model

REFUSED_WITHIN_S = 3.0  # the heartbeat timeout of the refused clients below


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    server_keys, stranger = root / "server-keys", root / "stranger-keys"
    keys.init_keys(server_keys)
    keys.init_keys(stranger)
    traces = root / "traces"
    server = Server(save_chat_model(root / "chat", seed=3), root / "serve.log",
                    "--auth", "curve", "--keys", str(server_keys), "--trace-dir", str(traces),
                    "--block-size", "8", "--num-kv-blocks", "64",
                    "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0")
    yield server, server_keys, stranger, traces.resolve()
    assert server.stop() == 0, server.log_text()


def allowed_client(server, folder) -> EngineClient:
    return EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15,
                        keys=keys.load_client_keys(folder))


def assert_refused(server, client_keys, why: str) -> None:
    """Nothing at all comes back, and the client says so (and why) within its heartbeat
    timeout."""
    client = EngineClient(server.command, server.state, timeout=60,
                          heartbeat_timeout=REFUSED_WITHIN_S, keys=client_keys)
    try:
        client.subscribe()
        with pytest.raises(EngineDead, match="not authorized or not reachable") as exc:
            client.hello()
        assert why in str(exc.value)
        assert all(client.latest(t) is None for t in ("heartbeat", "stats", "step"))
    finally:
        client.close()


def test_the_allowed_key_is_served(setup):
    server, server_keys, _, traces = setup
    with allowed_client(server, server_keys) as client:
        hello = client.hello()
        assert hello.trace_dir == str(traces)
        got = client.generate([3, 4, 5], {"max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert len(got.token_ids) == 4 and got.finish_reason == "length"
        client.subscribe(["heartbeat"])
        assert client.wait_frame("heartbeat", timeout=30) is not None


def test_a_plain_text_client_gets_nothing(setup):
    server, server_keys, *_ = setup
    assert_refused(server, None, "CURVE keys (attach with --keys DIR or --auth curve)")
    with allowed_client(server, server_keys) as client:
        assert client.hello().model  # still serving the others


def test_an_unknown_key_gets_nothing_until_it_is_allowed(setup):
    server, server_keys, stranger, _ = setup
    own = keys.load_client_keys(stranger)
    # the right engine key, but a client key the engine has never been told about
    knows_engine = keys.ClientKeys(own.public, own.secret,
                                   keys.load_server_keys(server_keys).public)
    assert_refused(server, knows_engine, "refused this client's public key")
    assert "unknown public key " + own.public.decode() in server.log_text()
    # a client with a wrong idea of the engine's key does not get in either
    assert_refused(server, own, "is the engine's public key the right one")
    keys.allow_client(server_keys, stranger / "client.key", name="stranger")
    try:
        with EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15,
                          keys=knows_engine) as client:
            assert client.hello().model  # admitted from the next handshake on, no restart
    finally:
        (server_keys / "allowed_clients" / "stranger.key").unlink()
    assert_refused(server, knows_engine, "refused this client's public key")


def zmtp_greeting(mechanism: bytes) -> bytes:
    return (b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0")
            + b"\0" + b"\0" * 31)


def test_garbage_at_the_handshake_never_crashes_the_engine(setup):
    server, server_keys, *_ = setup
    rng = __import__("random").Random(7)
    bodies = [os.urandom(64 * 1024), zmtp_greeting(b"NULL") + os.urandom(512),
              zmtp_greeting(b"PLAIN") + b"\x04\x26\x05HELLO" + os.urandom(32),
              zmtp_greeting(b"CURVE") + b"\x04\xc8\x05HELLO" + os.urandom(194),
              zmtp_greeting(b"CURVE") + b"\x06" + struct.pack(">Q", 2**62) + b"\x05HELLO",
              zmtp_greeting(b"CURVE")[:30]]
    for endpoint in (server.command, server.state):
        host, port = split_tcp(endpoint)
        for body in bodies + [bytes(rng.randrange(256) for _ in range(300))]:
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                try:
                    raw.sendall(body)
                    raw.settimeout(2)
                    raw.recv(4096)  # the server's greeting, or nothing: never a reply
                except OSError:
                    pass  # it hung up on us: fine
    assert server.proc.poll() is None
    with allowed_client(server, server_keys) as client:
        assert client.generate([7, 8], {"max_tokens": 2, "ignore_eos": True},
                               timeout=60).finish_reason == "length"


def test_trace_commands_write_only_under_the_trace_dir(setup, tmp_path):
    server, server_keys, _, traces = setup
    outside = tmp_path / "outside.jsonl"
    (traces / "sub").mkdir(exist_ok=True)
    (traces / "escape").symlink_to(tmp_path)
    try:
        with allowed_client(server, server_keys) as client:
            for path in (str(outside), "../outside.jsonl", "sub/../../outside.jsonl",
                         "escape/outside.jsonl", "/etc/kvscope-trace.jsonl", ""):
                with pytest.raises(EngineError) as exc:
                    client.trace_start(path)
                assert exc.value.code == "refused", path
            assert not outside.exists() and not (tmp_path / "outside.jsonl").exists()
            started = client.trace_start("sub/ok.jsonl")
            assert started.recording and started.path == str(traces / "sub" / "ok.jsonl")
            client.trace_stop()
            started = client.trace_start(str(traces / "abs.jsonl"))  # absolute, inside: fine
            assert started.path == str(traces / "abs.jsonl")
            client.trace_stop()
    finally:
        (traces / "escape").unlink()
    assert (traces / "sub" / "ok.jsonl").stat().st_size > 0


def replay_answer(endpoint: str, client_keys) -> list[bytes] | None:
    """Ask the KV-event replay ROUTER for everything from seq 0; its first reply, or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client_socket(sock, client_keys)
    sock.connect(endpoint)
    with contextlib.suppress(zmq.Again):  # the handshake was refused already: nowhere to send
        sock.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
    try:
        return sock.recv_multipart() if sock.poll(5000) else None
    finally:
        sock.close()
        ctx.term()


def test_the_kv_event_sockets_speak_curve_too(setup):
    server, server_keys, stranger, _ = setup
    found = re.search(r"KV events \(vLLM format\) on (\S+), replay on (\S+),",
                      server.log_text())
    assert found, server.log_text()
    replay = found.group(2)
    assert replay_answer(replay, None) is None  # plain text: nothing
    own = keys.load_client_keys(stranger)
    unknown = keys.ClientKeys(own.public, own.secret, keys.load_server_keys(server_keys).public)
    assert replay_answer(replay, unknown) is None
    answer = replay_answer(replay, keys.load_client_keys(server_keys))
    assert answer is not None and len(answer) == 3 and len(answer[1]) == 8  # (b"", seq, batch)
    # the vLLM-format subscriber takes the same keys
    with allowed_client(server, server_keys) as client:
        client.generate([9, 9, 9, 9, 9, 9, 9, 9, 9], {"max_tokens": 2}, timeout=60)
    subscriber = KVEventSubscriber(found.group(1), replay,
                                   keys=keys.load_client_keys(server_keys))
    try:
        deadline = time.monotonic() + 30
        replayed = []
        while not replayed and time.monotonic() < deadline:  # once the batch is published
            replayed = subscriber.replay_from(0)
        assert replayed and subscriber.counters.bad == 0
    finally:
        subscriber.close()
