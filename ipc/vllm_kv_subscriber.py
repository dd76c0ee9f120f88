"""A subscriber to a vLLM KV-event stream (vLLM's or `kvscope serve --kv-events`): batches in
sequence order, with gaps filled from the replay endpoint when there is one.

Not thread-safe: one thread owns it (the window's worker, or a test). Every payload is
untrusted: one that does not decode is counted and skipped, never raised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from kvscope.ipc import vllm_kv_events as v
from kvscope.ipc.curve import secure_client_socket
from kvscope.ipc.keys import ClientKeys

REPLAY_TIMEOUT_MS = 5000  # a replay that has not ended by then is abandoned (gap counted)
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class SubscriberCounters:
    received: int = 0  # batches delivered, live or replayed
    replayed: int = 0  # of those, from the replay endpoint
    missed: int = 0  # batches lost for good (no replay endpoint, or gone from its buffer)
    bad: int = 0  # payloads that were not KV-event batches


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 ctx: zmq.Context[Any] | None = None, hwm: int = 100_000,
                 keys: ClientKeys | None = None) -> None:
        """hwm: batches queued here before ZeroMQ drops newer ones (a gap, replayed later).
        keys: CURVE keys for a `kvscope serve` off loopback (None: plain, as vLLM speaks)."""
        self.ctx = ctx or zmq.Context.instance()
        self.topic = topic.encode()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sub.setsockopt(zmq.RCVHWM, hwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        secure_client_socket(self.sub, keys)
        self.sub.connect(endpoint)
        self.replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's buffer
            secure_client_socket(self.replay, keys)
            self.replay.connect(replay_endpoint)
        self.last_seq = -1
        self.counters = SubscriberCounters()

    def poll(self, timeout_ms: int) -> list[tuple[int, v.KVEventBatch]]:
        """Batches that arrived within timeout_ms (all that are queued, at most 1000), in order;
        a gap before one is replayed first when possible."""
        out: list[tuple[int, v.KVEventBatch]] = []
        if not self.sub.poll(timeout_ms):
            return out
        for _ in range(1000):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3:  # (topic, seq, payload); SUB already matched the topic
                self.counters.bad += 1
                continue
            try:
                seq = int.from_bytes(frames[1], "big") if len(frames[1]) == 8 else None
                if seq is None:
                    raise v.BadEventBatch("bad sequence frame")
                if seq <= self.last_seq:
                    continue  # already had it from a replay
                if self.last_seq >= 0 and seq > self.last_seq + 1:
                    out += self.replay_from(self.last_seq + 1, until=seq)
                batch = v.decode_batch(frames[2])
            except v.BadEventBatch:
                self.counters.bad += 1
                continue
            out.append((seq, batch))
            self.last_seq = seq
            self.counters.received += 1
        return out

    def replay_from(self, start: int, until: int | None = None) -> list[tuple[int, v.KVEventBatch]]:
        """Ask the replay endpoint for batches start..until-1 (until=None: all it has); what it
        cannot give is counted as missed."""
        got: list[tuple[int, v.KVEventBatch]] = []
        if self.replay is not None:
            self._drop_stale_replies(self.replay)
            try:  # a refused handshake leaves no pipe: a blocking send would never return
                self.replay.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
                sent = True
            except zmq.Again:
                sent = False  # nothing will come back: the gap is counted below
            while sent and self.replay.poll(REPLAY_TIMEOUT_MS):
                frames = self.replay.recv_multipart()
                if len(frames) < 3 or not frames[-1]:
                    break  # the end marker (seq -1, empty payload)
                seq = int.from_bytes(frames[-2], "big")
                if seq <= self.last_seq or (until is not None and seq >= until):
                    continue
                try:
                    batch = v.decode_batch(frames[-1])
                except v.BadEventBatch:
                    self.counters.bad += 1
                    continue
                self._count_gap(seq)
                got.append((seq, batch))
                self.last_seq = seq
                self.counters.received += 1
                self.counters.replayed += 1
        if until is not None:
            self._count_gap(until)
        return got

    @staticmethod
    def _drop_stale_replies(replay: zmq.Socket[bytes]) -> None:
        """The rest of an earlier replay that timed out: its end marker would end the next."""
        while True:
            try:
                replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def catch_up(self) -> list[tuple[int, v.KVEventBatch]]:
        """Replay whatever came after the last batch seen: a gap shows only when a later batch
        arrives, so losses at the end of a burst need this (call it when the stream is quiet)."""
        return self.replay_from(self.last_seq + 1)

    def _count_gap(self, seq: int) -> None:
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            self.counters.missed += seq - self.last_seq - 1
            self.last_seq = seq - 1

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
