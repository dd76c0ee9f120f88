"""The I/O thread of `kvscope serve`: it owns every socket and reads only the engine's
counters (for the heartbeat).

It decodes and validates commands (garbage is answered or dropped here), queues good ones for
the engine thread (engine_server.py), forwards what that thread produced, tracks
subscriptions and sends the 1 Hz heartbeat.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from typing import Any, Protocol

import zmq

from kvscope.engine.server import snapshots
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.ipc.curve import ServerAuth, secure_server_socket
from kvscope.ipc.endpoints import is_ipv6


class ServerSide(Protocol):
    """What the I/O thread needs of the engine server (engine_server.py), named here so
    that this module does not import the one that imports it."""

    ctx: zmq.Context
    commands: queue.SimpleQueue
    engine: Any
    max_message_bytes: int
    auth: ServerAuth | None

    def request_stop(self) -> None: ...

HEARTBEAT_S = 1.0
PUB_HWM = 16  # messages per subscriber; beyond that PUB drops (newer state follows anyway)
ROUTER_SNDHWM = 100_000  # per client; a client this far behind loses its requests
WAKE = object()  # tells the engine thread to publish now (a new subscriber arrived)


class ClientGone:
    """The I/O thread could not route to this client any more."""

    def __init__(self, identity: bytes) -> None:
        self.identity = identity


class IOThread(threading.Thread):
    """Owns the sockets; reads only counters of the engine (for the heartbeat)."""

    def __init__(self, server: ServerSide, command_endpoint: str, state_endpoint: str):
        super().__init__(name="kvscope-io", daemon=True)
        self.server = server
        ctx = server.ctx
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> error we can count
        # A client reconnecting under its fixed routing id takes its requests' streams along.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, server.max_message_bytes)
        self.router.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self.pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # see every (un)subscription: count them
        self.pub.setsockopt(zmq.MAXMSGSIZE, 1024)  # subscriptions are short
        for sock in (self.router, self.pub):
            secure_server_socket(sock, server.auth)  # no-op in plain-text mode
        self.endpoints = (_bind(self.router, command_endpoint), _bind(self.pub, state_endpoint))
        self.inproc = f"inproc://kvscope-engine-{id(self)}"
        self.pair = ctx.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.RCVHWM, 0)
        self.pair.bind(self.inproc)
        self.subscriptions: dict[bytes, int] = {}
        self.prefixes: frozenset[bytes] = frozenset()
        self.bad_frames = self.dropped = self.state_forwarded = self.heartbeat_seq = 0
        self.started = time.monotonic()

    def wanted(self, topic: str) -> bool:
        t = topic.encode()
        return any(t.startswith(p) for p in self.prefixes)

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.pair, self.router, self.pub):
            poller.register(s, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                events = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self.pair in events and not self._forward():
                    break
                if self.router in events:
                    self._read_commands()
                if self.pub in events:
                    self._read_subscriptions()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + HEARTBEAT_S
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            self.server.request_stop()
        finally:
            for s in (self.router, self.pub, self.pair):
                s.close(linger=1000)  # let the last replies (shutdown's) reach their clients

    def _forward(self) -> bool:
        """Send what the engine thread produced; False once it says stop."""
        for _ in range(1000):
            try:
                frames = self.pair.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            kind = frames[0].bytes
            if kind == b"S":
                return False
            if kind == b"P":
                self.state_forwarded += 1
                self._send(self.pub, frames[1:])
            else:
                self._reply(frames[1].bytes, frames[2])
        return True

    def _reply(self, identity: bytes, payload) -> None:
        try:
            self.router.send_multipart([identity, payload], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # gone (EHOSTUNREACH) or hopelessly behind (EAGAIN)
            self.dropped += 1
            self.server.commands.put(ClientGone(identity))

    def _send(self, sock, frames) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.dropped += 1

    def _read_commands(self) -> None:
        for _ in range(1000):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                if len(body) != 1:
                    raise codec.BadMessage(m.MALFORMED, f"expected one frame after the routing "
                                           f"id, got {len(body)}")
                self.server.enqueue(identity, codec.decode_command(body[0]))
            except codec.BadMessage as exc:
                self.bad_frames += 1
                self._reply(identity, codec.encode(m.Error(exc.call_id, exc.code, exc.message)))

    def _read_subscriptions(self) -> None:
        while True:
            try:
                msg = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not msg or msg[0] not in (0, 1):
                continue
            prefix, delta = msg[1:], (1 if msg[0] else -1)
            self.subscriptions[prefix] = self.subscriptions.get(prefix, 0) + delta
            if delta > 0:
                self.server.commands.put(WAKE)  # publish now, for the newcomer
        self.prefixes = frozenset(p for p, n in self.subscriptions.items() if n > 0)

    def _heartbeat(self) -> None:
        self.heartbeat_seq += 1
        engine = self.server.engine
        beat = snapshots.heartbeat(self.heartbeat_seq, engine.num_steps, self.started,
                                   engine.has_unfinished(), self.bad_frames)
        self._send(self.pub, [b"heartbeat", codec.encode(beat)])


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; a tcp port of 0 or * picks a free one. Returns the endpoint actually bound."""
    if is_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def log(msg: str) -> None:
    print(f"kvscope serve: {msg}", file=sys.stderr, flush=True)
