"""`kvscope serve --kv-events`: the prefix cache's changes as vLLM's KV-event stream.

Two halves, one per thread:

* `CacheEventFeed` (engine thread): after each step it takes what the block manager recorded
  (engine/kv_cache/events.py), turns it into one vLLM `KVEventBatch` (chains of stored blocks
  become one BlockStored each, as vLLM sends them) and appends it to a bounded deque: no
  socket, no syscall, so the engine thread never gives up the GIL here (a zmq send does, and
  on a busy machine getting it back cost a millisecond a batch). A full deque drops the batch
  and counts it. A new block manager (the pool was rebuilt) is an AllBlocksCleared.
* `KVEventPublisher` (its own thread): every few milliseconds it takes the deque's batches,
  encodes and numbers each, sends it on the PUB socket as (topic, 8-byte big-endian seq,
  payload), keeps the last `buffer_steps` for replay and answers replay requests on the
  ROUTER, as vLLM's ZmqEventPublisher does. A subscriber slower than the PUB high-water mark
  loses messages there (ZeroMQ drops them silently, so it is the subscriber that counts the gap
  in seq) and can replay them.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count

import zmq

from kvscope.engine.kv_cache.events import BlockCached, BlockUncached
from kvscope.ipc import messages as m
from kvscope.ipc import vllm_kv_events as v
from kvscope.ipc.curve import ServerAuth, secure_server_socket
from kvscope.ipc.endpoints import is_ipv6

HASH_MASK = (1 << 64) - 1  # hashes go out as unsigned 64-bit ints, as vLLM's int hashes do
FULL_ATTENTION = "full_attention"  # vLLM's kind for a plain decoder's one KV-cache group
MAX_QUEUED = 100_000  # batches handed over and not yet published (vLLM's max_queue_size)
BUSY_POLL_MS = 2  # how often the publisher thread looks for batches while they flow
IDLE_POLL_MS = 50  # ... and after IDLE_AFTER_S without any
IDLE_AFTER_S = 1.0
# The replay ROUTER's cap on one incoming wire message. A request is 8 bytes, but ZeroMQ
# checks the cap on every frame the connection carries, CURVE's handshake included (HELLO
# is 200 bytes, INITIATE about 300 with its metadata), so a tighter cap refuses every
# secured client. Anything larger than this is dropped by ZeroMQ with its connection.
REPLAY_MAX_WIRE_BYTES = 1024


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str  # PUB, bound
    replay_endpoint: str | None = None  # ROUTER, bound
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay (vLLM's default)
    hwm: int = 100_000  # PUB high-water mark per subscriber (vLLM's default)


def event_socket(ctx: zmq.Context, kind: int, endpoint: str, auth: ServerAuth | None = None,
                 options: dict[int, int] | None = None) -> tuple[zmq.Socket, str]:
    """Create and bind one KV-event socket; returns it and the endpoint actually bound (a tcp
    port of 0 or * picks a free one). Every KV-event socket is made here; with auth it speaks
    CURVE and admits only allowed client keys, as the command and state sockets do.

    options are set before the bind: a listener copies the socket's options when it binds, so
    a high-water mark or size cap set afterwards never reaches the connections it accepts."""
    sock = ctx.socket(kind)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    secure_server_socket(sock, auth)
    if is_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher(threading.Thread):
    """Owns the PUB and replay sockets; takes batches from `queue` (filled by a CacheEventFeed)."""

    def __init__(self, config: KVEventsConfig, ctx: zmq.Context | None = None,
                 auth: ServerAuth | None = None) -> None:
        super().__init__(name="kvscope-kv-events", daemon=True)
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        self.topic = config.topic.encode()
        self.queue: deque[v.KVEventBatch] = deque()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seqs = count()
        self.sent = self.replays = self.bad_replays = self.send_errors = self.bytes = 0
        self.stopping = threading.Event()
        self.pub, pub_at = event_socket(self.ctx, zmq.PUB, config.endpoint, auth,
                                        {zmq.SNDHWM: config.hwm})
        self.replay = None
        replay_at = None
        try:
            if config.replay_endpoint:
                self.replay, replay_at = event_socket(self.ctx, zmq.ROUTER,
                                                      config.replay_endpoint, auth, {
                    zmq.MAXMSGSIZE: REPLAY_MAX_WIRE_BYTES,
                    # Room for one whole replay; beyond that a send fails (and is counted)
                    # instead of silently losing batches or the end marker.
                    zmq.SNDHWM: config.buffer_steps + 1,
                    zmq.ROUTER_MANDATORY: 1,
                })
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoints = (pub_at, replay_at)

    def run(self) -> None:
        idle_since = time.monotonic()
        try:
            while not self.stopping.is_set():
                busy = time.monotonic() - idle_since < IDLE_AFTER_S
                wait_ms = BUSY_POLL_MS if busy else IDLE_POLL_MS
                if self.replay is not None:
                    if self.replay.poll(wait_ms):
                        self._serve_replays()
                else:
                    self.stopping.wait(wait_ms / 1000)
                if self._forward():
                    idle_since = time.monotonic()
            self._forward()  # what the engine thread handed over before the stop
        finally:
            self._close_sockets()

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)

    def _forward(self) -> int:
        """Publish the queued batches; returns how many."""
        n = 0
        while self.queue:
            payload = v.encode_batch(self.queue.popleft())
            self.bytes += len(payload)
            seq = next(self.seqs)
            try:
                self.pub.send_multipart((self.topic, v.seq_bytes(seq), payload), zmq.NOBLOCK)
                self.sent += 1
            except zmq.ZMQError:
                self.send_errors += 1  # still buffered: a replay will deliver it
            self.buffer.append((seq, payload))
            n += 1
        return n

    def _serve_replays(self) -> None:
        for _ in range(100):
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # REQ clients put an empty delimiter before the request, DEALERs need not.
            envelope, request = frames[:-1], frames[-1]
            if len(request) != 8 or not 1 <= len(envelope) <= 2:
                self.bad_replays += 1
                continue
            start = int.from_bytes(request, "big")  # unsigned, as vLLM reads it
            self.replays += 1
            try:
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        self.replay.send_multipart((*envelope, v.seq_bytes(seq), payload),
                                                   zmq.NOBLOCK)
                self.replay.send_multipart((*envelope, v.END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError:
                self.bad_replays += 1  # the client is gone or hopelessly behind

    def _close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)


class CacheEventFeed:
    """Engine-thread side: block-manager records in, vLLM batches onto the publisher's deque."""

    def __init__(self, engine, publisher: KVEventPublisher) -> None:
        self.engine = engine
        self.publisher = publisher
        self.queue = publisher.queue
        self.medium = v.MEDIUM_GPU if str(engine.device).startswith("cuda") else v.MEDIUM_CPU
        self.batches = self.events = self.dropped = 0
        self.publish_s = 0.0  # engine-thread time spent here
        self.block_manager = None
        self._attach()

    def _attach(self) -> None:
        self.block_manager = self.engine.block_manager
        self.block_manager.cache_events = []

    def flush(self) -> v.KVEventBatch | None:
        """Hand over what changed since the last flush (at most one batch); returns it."""
        started = time.perf_counter()
        records = self.block_manager.cache_events
        cleared = self.engine.block_manager is not self.block_manager
        if not records and not cleared:
            return None
        self.block_manager.cache_events = []
        events = to_vllm_events(records, self.block_manager.block_size, self.medium)
        if cleared:
            # Every hash the old pool held goes, then the clear itself: a consumer that
            # ignores AllBlocksCleared still ends up with an empty index.
            gone = [BlockUncached(h) for h in self.block_manager.hash_to_block]
            events += to_vllm_events(gone, self.block_manager.block_size, self.medium)
            events.append(v.AllBlocksCleared())
            self._attach()
        batch = v.KVEventBatch(time.time(), events, 0)
        if len(self.queue) < MAX_QUEUED:
            self.queue.append(batch)
            self.batches += 1
            self.events += len(events)
        else:
            self.dropped += 1  # the publisher thread is stuck: never wait for it
        self.publish_s += time.perf_counter() - started
        return batch

    def counters(self) -> m.KVEventCounters:
        p = self.publisher
        return m.KVEventCounters(batches=self.batches, events=self.events,
                                 batches_dropped=self.dropped, publish_s=self.publish_s,
                                 replays=p.replays, bad_replays=p.bad_replays)

    def close(self) -> None:
        """Stop the publisher thread (after the engine thread is done with this feed)."""
        self.publisher.stop()


def to_vllm_events(records, block_size: int, medium: str) -> list[v.KVEvent]:
    """Block-manager records in order as vLLM events: a run of cached blocks that chain
    (each one's parent is the one before) is one BlockStored, a run of removals one
    BlockRemoved."""
    out: list[v.KVEvent] = []
    for r in records:
        last = out[-1] if out else None
        where = r.medium or medium  # a tier's own (CPU, STORAGE), else the pool's
        if isinstance(r, BlockCached):
            h = r.block_hash & HASH_MASK
            parent = None if r.parent_hash is None else r.parent_hash & HASH_MASK
            if isinstance(last, v.BlockStored) and last.medium == where \
                    and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)
                last.token_ids.extend(r.token_ids)
            else:
                out.append(v.BlockStored([h], parent, list(r.token_ids), block_size, None,
                                         where, None, group_idx=0,
                                         kv_cache_spec_kind=FULL_ATTENTION))
        elif isinstance(r, BlockUncached):
            h = r.block_hash & HASH_MASK
            if isinstance(last, v.BlockRemoved) and last.medium == where:
                last.block_hashes.append(h)
            else:
                out.append(v.BlockRemoved([h], where, group_idx=0))
    return out
