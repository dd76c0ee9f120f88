"""Hostile and chaotic clients against a real `kvscope serve`: garbage frames, a seeded storm
of submits and aborts, vanishing clients. Afterwards the pool is clean and the engine answers."""
from __future__ import annotations

import random
import threading
import time

import msgspec
import pytest
import zmq

from kvscope.ipc import EngineClient, EngineError, codec
from kvscope.ipc import messages as m
from tests.support.server_harness import Server, save_chat_model

POOL_BLOCKS = 48  # 192 slots of 4: the storm preempts
ARGS = ["--block-size", "4", "--num-kv-blocks", str(POOL_BLOCKS), "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--max-message-bytes", "65536"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_chat_model(tmp_path_factory.mktemp("chat"), seed=2)
    s = Server(model, tmp_path_factory.mktemp("serve") / "serve.log", *ARGS)
    yield s
    s.stop()


# -- garbage ---------------------------------------------------------------------------------
def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bytes", "none", "bool", "bigint"]
    if depth < 3:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return {"int": lambda: rng.randint(-10, 300), "float": lambda: rng.uniform(-1e9, 1e9),
            "str": lambda: random_text(rng), "bytes": lambda: rng.randbytes(rng.randint(0, 9)),
            "none": lambda: None, "bool": lambda: rng.random() < 0.5,
            "bigint": lambda: rng.choice([2**63, -(2**63), 2**64 - 1])}[kind]()


def random_text(rng: random.Random) -> str:
    return rng.choice(["type", "id", "prompt", "sampling", "max_tokens", "", "é", "\x00"]) \
        if rng.random() < 0.3 else "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(3))


# Commands that are harmless even when a mutation leaves them valid (no shutdown, short work).
TEMPLATES = [
    {"type": "submit", "id": 1, "token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}},
    {"type": "submit", "id": 2, "messages": [{"role": "user", "content": "hi"}],
     "sampling": {"max_tokens": 2, "stop": ["a"]}},
    {"type": "abort", "id": 3, "request_id": "req-x"},
    {"type": "reconfigure", "id": 4, "changes": {"no_such_option": 1}},
    {"type": "hello", "id": 5, "protocol": 1},
    {"type": "snapshot", "id": 6},
]


def mutated_command(rng: random.Random) -> dict:
    msg = msgspec.msgpack.decode(msgspec.msgpack.encode(rng.choice(TEMPLATES)))
    for _ in range(rng.randint(1, 3)):
        action = rng.choice(["retype", "drop", "add", "nested"])
        key = rng.choice(list(msg) or ["id"])
        if action == "retype":
            msg[key] = random_value(rng)
        elif action == "drop":
            msg.pop(key, None)
        elif action == "add":
            msg[random_text(rng)] = random_value(rng)
        elif isinstance(msg.get("sampling"), dict):
            msg["sampling"][rng.choice(["max_tokens", "temperature", "top_p", "stop", "x"])] = \
                random_value(rng)
    if msg.get("type") == "shutdown" or (msg.get("type") == "reconfigure"
                                         and msg.get("changes") != {"no_such_option": 1}):
        msg["type"] = "snapshot-not"  # never let a mutation stop or reshape the server
    return msg


def garbage_frames(rng: random.Random) -> list[bytes]:
    kind = rng.random()
    if kind < 0.25:
        return [rng.randbytes(rng.randint(0, 200))]
    if kind < 0.45:
        return [msgspec.msgpack.encode(random_value(rng))]
    if kind < 0.85:
        return [msgspec.msgpack.encode(mutated_command(rng))]
    if kind < 0.97:  # wrong frame counts
        return [rng.randbytes(rng.randint(0, 20)) for _ in range(rng.choice([0, 2, 3, 5]))] or [b""]
    return [b"\x91" * rng.randint(1000, 20000) + b"\xc0"]  # deep nesting


def test_thousands_of_garbage_frames_then_a_normal_request(server, client):
    rng = random.Random(1234)
    replies = []
    with zmq.Context() as ctx:
        raw = ctx.socket(zmq.DEALER)
        raw.connect(server.command)
        for _ in range(3000):
            raw.send_multipart(garbage_frames(rng))
            while raw.poll(0):
                replies.append(raw.recv_multipart())
        while raw.poll(1000):
            replies.append(raw.recv_multipart())
        decoded = [codec.decode_reply(r[-1]) for r in replies if len(r) == 1]
        # Each frame got its reply (a few valid submits also stream deltas), all well-formed.
        assert len(decoded) == len(replies) >= 3000
        raw.send(b"\x00" * 70_000)  # over --max-message-bytes: libzmq drops the connection
        # ... and the DEALER reconnects: the socket still works (what was in flight on the
        # dropped connection is lost, so retry like a client with a timeout would).
        after = []
        for call_id in range(100, 120):
            raw.send(codec.encode(m.Hello(id=call_id, protocol=m.PROTOCOL_VERSION)))
            after += _drain(raw, 0.5)
            if after:
                break
        assert after and all(isinstance(x, m.Ok) for x in after)  # the big one never arrived
        raw.close(linger=0)
    codes = {x.code for x in decoded if isinstance(x, m.Error)}
    assert {"malformed", "unknown_type", "invalid", "unknown_request"} <= codes
    assert "internal" not in codes and "Traceback" not in server.log_text()
    assert server.proc.poll() is None
    out = client.generate([5, 6, 7], {"max_tokens": 5, "ignore_eos": True}, timeout=60)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert client.wait_frame("heartbeat", 5).bad_frames >= 1000


def _drain(sock, quiet_s: float) -> list:
    out = []
    while sock.poll(quiet_s * 1000):
        out.append(codec.decode_reply(sock.recv()))
    return out


# -- storm -----------------------------------------------------------------------------------
def random_sampling(rng: random.Random) -> dict:
    return {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 0.7, 1.5]),
            "top_k": rng.choice([0, 5]), "top_p": rng.choice([1.0, 0.8]),
            "seed": rng.choice([None, rng.randint(0, 99)]), "ignore_eos": rng.random() < 0.5,
            "stop": rng.choice([[], ["e"], ["ab", "x"]])}


def random_prompt(rng: random.Random):
    if rng.random() < 0.3:
        return [{"role": "user", "content": "q" * rng.randint(1, 40)}]
    if rng.random() < 0.5:
        return "text " * rng.randint(1, 10)
    return [rng.randint(0, 254) for _ in range(rng.randint(1, 60))]


def test_storm_of_submits_and_aborts_leaves_every_block_free(server, client):
    rng = random.Random(7)
    done: dict[str, str] = {}
    lock = threading.Lock()

    def on_delta(d):
        if d.finished:
            with lock:
                done[d.request_id] = d.finish_reason

    client.subscribe(["blocks"])
    submitted = []
    quitter = EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15)
    for _ in range(4):  # this client vanishes with requests in flight
        quitter.submit([1, 2, 3, 4], {"max_tokens": 300, "ignore_eos": True},
                       on_delta=lambda d: None)
    quitter.close()
    for _ in range(150):
        op = rng.random()
        if op < 0.6 or not submitted:
            submitted.append(client.submit(random_prompt(rng), random_sampling(rng),
                                           on_delta=on_delta))
        elif op < 0.9:
            client.abort(rng.choice(submitted))
        else:
            with pytest.raises(EngineError, match="unknown_request"):
                client.abort(f"nope-{rng.random()}")
        time.sleep(rng.random() * 0.004)
    deadline = time.monotonic() + 90
    while len(done) < len(submitted) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(done) == set(submitted)
    assert "abort" in done.values() and "length" in done.values()
    snap = _wait_idle(client)
    blocks = snap.blocks
    assert blocks.request_ids == [] and blocks.used == 0
    assert blocks.free + blocks.cached == POOL_BLOCKS
    flags = blocks.array("flags") & m.BLOCK_STATE_MASK
    assert set(flags.tolist()) <= {m.BLOCK_FREE, m.BLOCK_CACHED}
    assert (blocks.array("ref_count") == 0).all()
    frame = client.wait_frame("blocks", 10, lambda f: f.step == blocks.step)
    assert frame.used == 0 and frame.flags == blocks.flags
    assert snap.stats.engine.num_preemptions > 0  # the small pool really was contended
    assert client.generate("still here", {"max_tokens": 3}, timeout=60).finish_reason


def _wait_idle(client, timeout=60.0) -> m.SnapshotResult:
    """The quitter's requests end once the server finds it cannot route their deltas."""
    deadline = time.monotonic() + timeout
    while True:
        snap = client.snapshot()
        if not snap.blocks.request_ids or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


def test_shutdown_aborts_in_flight_requests_and_exits(server, client):
    rid = client.submit([3, 1, 4, 1, 5], {"max_tokens": 400, "ignore_eos": True})
    stream = client.stream(rid, timeout=30)
    next(stream)
    assert client.shutdown().aborted == [rid]
    assert list(stream)[-1].finish_reason == "abort"
    assert server.proc.wait(30) == 0
