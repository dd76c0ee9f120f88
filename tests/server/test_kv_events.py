"""vLLM's KV-event format: kvscope's bytes against an independent copy of vLLM's decoder
structs and the raw msgpack layout, the block manager's records, and the PUB/replay wire."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.kv_cache.events import BlockCached, BlockUncached
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sequence import Sequence
from kvscope.engine.server import kv_events
from kvscope.engine.server.kv_events import (
    HASH_MASK,
    CacheEventFeed,
    KVEventPublisher,
    KVEventsConfig,
    to_vllm_events,
)
from kvscope.ipc import vllm_kv_events as v
from kvscope.ipc.vllm_kv_subscriber import KVEventSubscriber


# -- vLLM's decoder side, written from vllm/distributed/kv_events.py (main, = v0.28.0) --------
# Kept independent of ipc/vllm_kv_events.py on purpose: if kvscope's schema drifts, these fail.
class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(VEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(VEvent):
    pass


class KVEventBatch(VBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def sample_batch() -> v.KVEventBatch:
    return v.KVEventBatch(1700000000.5, [
        v.BlockStored([11, 12], 10, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0,
                      kv_cache_spec_kind="full_attention"),
        v.BlockRemoved([10], "GPU", group_idx=0),
        v.AllBlocksCleared(),
    ], 0)


def test_vllms_decoder_reads_kvscopes_bytes():
    got = VLLM_DECODER.decode(v.encode_batch(sample_batch()))
    assert got.ts == 1700000000.5 and got.data_parallel_rank == 0
    stored, removed, cleared = got.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 12]
    assert stored.parent_block_hash == 10 and stored.token_ids == [1, 2, 3, 4]
    assert (stored.block_size, stored.medium, stored.group_idx) == (2, "GPU", 0)
    assert stored.kv_cache_spec_kind == "full_attention" and stored.lora_id is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [10]
    assert isinstance(cleared, AllBlocksCleared)


def test_raw_msgpack_layout_is_vllms():
    """A batch is an array [ts, events, rank]; an event a map whose first key is "type", then
    the fields in declaration order, defaults left out (the required ones even when None)."""
    raw = msgspec.msgpack.decode(v.encode_batch(sample_batch()))
    assert isinstance(raw, list) and len(raw) == 3
    ts, events, rank = raw
    assert ts == 1700000000.5 and rank == 0
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name", "group_idx",
                               "kv_cache_spec_kind"]
    assert events[0]["type"] == "BlockStored" and events[0]["lora_id"] is None
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [10], "medium": "GPU",
                         "group_idx": 0}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_reads_a_batch_built_by_hand_from_the_documented_schema():
    """What a vLLM server sends (bytes hashes, extra keys, a field kvscope does not know)."""
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = msgspec.msgpack.encode([1.25, [
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
         "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention", "some_future_field": 7},
        {"type": "BlockRemoved", "block_hashes": [h1], "medium": "GPU"},
    ], 1])
    batch = v.decode_batch(payload)
    assert batch.data_parallel_rank == 1
    assert batch.events[0].block_hashes == [h1, h2] and batch.events[0].token_ids == \
        list(range(32))
    assert batch.events[1].block_hashes == [h1]


def test_reads_the_older_array_encoding():
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [5, 6], None, [1, 2, 3, 4], 2,
                                             None, "GPU"],
                                            ["BlockRemoved", [5], "GPU"],
                                            ["AllBlocksCleared"]]])
    batch = v.decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved",
                                                         "AllBlocksCleared"]
    assert batch.events[0].block_hashes == [5, 6] and batch.events[0].medium == "GPU"


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])])
def test_garbage_is_a_clear_error(payload):
    with pytest.raises(v.BadEventBatch, match="not a vLLM KV-event batch"):
        v.decode_batch(payload)


# -- what the block manager records ----------------------------------------------------------
def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler does for a whole-prompt chunk."""
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size
    bm.allocate(seq, hits, n)
    bm.commit_full_blocks(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)


def test_full_blocks_are_recorded_with_their_chain_and_tokens():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.cache_events = []
    seq = seq_of([1, 2, 3, 4, 5])
    run_prefill(bm, seq)
    assert bm.cache_events == [BlockCached(seq.block_hashes[0], None, (1, 2)),
                               BlockCached(seq.block_hashes[1], seq.block_hashes[0], (3, 4))]
    # A second request with the same prefix shares the blocks: nothing new enters the cache.
    bm.cache_events.clear()
    run_prefill(bm, seq_of([1, 2, 3, 4, 9], "r2"))
    assert bm.cache_events == []


def test_eviction_and_reset_are_recorded():
    bm = BlockManager(2, 2, enable_prefix_caching=True)
    bm.cache_events = []
    a = seq_of([1, 2, 3])
    run_prefill(bm, a)
    bm.free(a)  # its full block stays cached-free
    bm.cache_events.clear()
    b = seq_of([7, 8, 9, 10, 11], "b")  # needs both blocks: the cached one is evicted
    bm.allocate(b, [], 3)
    assert bm.cache_events == [BlockUncached(a.block_hashes[0])]
    bm.commit_full_blocks(b, 0, 3)
    bm.free(b)
    bm.cache_events.clear()
    bm.reset_prefix_cache()
    assert bm.cache_events == [BlockUncached(b.block_hashes[0])]


def test_nothing_is_recorded_unless_asked():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    run_prefill(bm, seq_of([1, 2, 3]))
    assert bm.cache_events is None


def test_chains_become_one_block_stored_as_vllm_sends_them():
    records = [BlockCached(-5, None, (1, 2)), BlockCached(6, -5, (3, 4)),
               BlockCached(9, None, (7, 7)), BlockUncached(6), BlockUncached(9)]
    stored, other, removed = to_vllm_events(records, 2, "CPU")
    assert stored.block_hashes == [-5 & HASH_MASK, 6] and stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4] and stored.medium == "CPU"
    assert all(0 <= h < 2**64 for h in stored.block_hashes)  # unsigned on the wire
    assert other.block_hashes == [9] and other.token_ids == [7, 7]
    assert removed.block_hashes == [6, 9]


# -- the wire: PUB frames, replay, never blocking ----------------------------------------------
class FakeEngine:
    """What CacheEventFeed reads of an LLMEngine."""

    def __init__(self, bm: BlockManager) -> None:
        self.block_manager, self.device = bm, "cpu"


@pytest.fixture
def publisher():
    ctx = zmq.Context()
    yield KVEventPublisher(KVEventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv",
                                          buffer_steps=4), ctx)
    ctx.destroy(linger=0)


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"kv") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def connect_and_flush(feed: CacheEventFeed, bm: BlockManager, sub: zmq.Socket) -> list:
    """Publish one stored block per flush until the (slow-joining) subscriber sees one."""
    for i in range(200):
        bm.cache_events.append(BlockCached(1000 + i, None, (i, i)))
        feed.flush()
        if sub.poll(25):
            return sub.recv_multipart()
    raise AssertionError("the subscriber never received a batch")


def test_pub_frames_and_replay_are_vllms(publisher):
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    publisher.start()
    feed = CacheEventFeed(FakeEngine(bm), publisher)
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, publisher.endpoints[0])
        topic, seq, payload = connect_and_flush(feed, bm, sub)
        assert topic == b"kv" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        assert VLLM_DECODER.decode(payload).events[0].token_ids == [first, first]
        for h in (1, 2):  # two more batches: seq counts up by one per batch
            bm.cache_events.append(BlockUncached(h))
            feed.flush()
        seqs = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(2)]
        assert seqs == [first + 1, first + 2]
        # Replay from first + 1 with a REQ envelope (empty delimiter), as vLLM's subscribers
        # send it; a DEALER, because a REQ socket takes only the first of the replies.
        req = ctx.socket(zmq.DEALER)
        req.connect(publisher.endpoints[1])
        req.send_multipart([b"", (first + 1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert req.poll(10_000)
            delimiter, seq_b, body = req.recv_multipart()
            assert delimiter == b""
            if seq_b == v.END_SEQ:
                assert body == b""
                break
            replayed.append((int.from_bytes(seq_b, "big"),
                             VLLM_DECODER.decode(body).events[0].block_hashes))
        assert replayed == [(first + 1, [1]), (first + 2, [2])]
    finally:
        feed.close()
        ctx.destroy(linger=0)
    assert not publisher.is_alive()


def test_replay_keeps_only_the_last_buffer_steps(publisher):
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    publisher.start()
    feed = CacheEventFeed(FakeEngine(bm), publisher)
    ctx = zmq.Context()
    try:
        for h in range(10):
            bm.cache_events.append(BlockUncached(h))
            feed.flush()
        dealer = ctx.socket(zmq.DEALER)  # no empty delimiter: answered all the same
        dealer.connect(publisher.endpoints[1])
        deadline = time.monotonic() + 10
        while publisher.sent + publisher.send_errors < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        dealer.send((0).to_bytes(8, "big"))
        got = []
        while True:
            assert dealer.poll(10_000)
            seq_b, body = dealer.recv_multipart()
            if not body:
                break
            got.append(int.from_bytes(seq_b, "big"))
        assert got == [6, 7, 8, 9]  # buffer_steps=4
        dealer.send(b"short")  # not 8 bytes: counted, not answered
        deadline = time.monotonic() + 10
        while publisher.bad_replays == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert publisher.bad_replays == 1 and not dealer.poll(100)
    finally:
        feed.close()
        ctx.destroy(linger=0)


def test_replay_socket_options_reach_accepted_connections(publisher):
    """The replay ROUTER's options are set before its bind: a listener copies them at bind
    time, so set afterwards they never applied (the request size cap, and a high-water
    mark left at ZeroMQ's 1000 that cut replays longer than that short under load). An
    oversized request is dropped by ZeroMQ itself and never reaches the publisher."""
    publisher.start()
    ctx = zmq.Context()
    try:
        big = ctx.socket(zmq.DEALER)
        big.connect(publisher.endpoints[1])
        big.send(b"x" * (kv_events.REPLAY_MAX_WIRE_BYTES + 1))
        ok = ctx.socket(zmq.DEALER)  # then a well-formed request on another connection
        ok.connect(publisher.endpoints[1])
        ok.send((0).to_bytes(8, "big"))
        assert ok.poll(10_000)
        assert ok.recv_multipart() == [v.END_SEQ, b""]  # nothing published yet: just the end
        time.sleep(0.2)
        assert (publisher.replays, publisher.bad_replays) == (1, 0)
        assert not big.poll(100)
    finally:
        publisher.stop()
        ctx.destroy(linger=0)


def test_a_stalled_publisher_never_blocks_the_engine_thread(publisher, monkeypatch):
    """The publisher thread is not running: the hand-over fills, then batches are dropped
    and counted, and flush() keeps returning at once."""
    monkeypatch.setattr(kv_events, "MAX_QUEUED", 100)
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    feed = CacheEventFeed(FakeEngine(bm), publisher)
    for h in range(250):
        bm.cache_events.append(BlockUncached(h))
        assert feed.flush() is not None
    assert (feed.batches, feed.dropped) == (100, 150)
    assert feed.counters().batches_dropped == 150
    publisher.start()  # unstuck: what was handed over goes out
    feed.close()
    assert publisher.sent == 100 and [s for s, _ in publisher.buffer] == [96, 97, 98, 99]


def test_a_new_block_manager_is_all_blocks_cleared(publisher):
    engine = FakeEngine(BlockManager(8, 2, enable_prefix_caching=True))
    feed = CacheEventFeed(engine, publisher)
    assert feed.flush() is None  # nothing changed: no batch
    old = engine.block_manager
    run_prefill(old, seq_of([1, 2, 3, 4, 5]))  # two hashes in the old pool's cache
    old.cache_events.clear()
    old.cache_events.append(BlockUncached(3))
    engine.block_manager = BlockManager(4, 4, enable_prefix_caching=True)  # reconfigure
    batch = feed.flush()
    removed, gone, cleared = batch.events
    assert removed.block_hashes == [3]
    assert gone.block_hashes == [h & HASH_MASK for h in old.hash_to_block]
    assert len(gone.block_hashes) == 2
    assert isinstance(cleared, v.AllBlocksCleared)
    assert engine.block_manager.cache_events == []  # recording on the new pool


def test_a_slow_subscriber_loses_pub_messages_and_replays_them():
    ctx = zmq.Context()
    pub = KVEventPublisher(KVEventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                                          buffer_steps=10_000, hwm=2), ctx)
    pub.start()
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    feed = CacheEventFeed(FakeEngine(bm), pub)
    sub = KVEventSubscriber(*pub.endpoints, ctx=ctx, hwm=2)
    try:
        first = connect_and_flush(feed, bm, sub.sub)  # connected
        sub.last_seq = int.from_bytes(first[1], "big")
        time.sleep(0.3)
        while sub.sub.poll(100):  # what connect_and_flush published, read raw
            sub.last_seq = int.from_bytes(sub.sub.recv_multipart()[1], "big")
        start = sub.last_seq
        n, tokens = 5000, tuple(range(1024))  # ~3 KB a batch: more than the TCP buffers hold
        for h in range(n):  # the subscriber reads nothing meanwhile
            bm.cache_events.append(BlockCached(h, None, tokens))
            feed.flush()
        deadline = time.monotonic() + 60
        while pub.sent + pub.send_errors < start + 1 + n and time.monotonic() < deadline:
            time.sleep(0.01)
        got = []
        while batches := sub.poll(500):
            got += batches
        got += sub.catch_up()  # the burst's tail, if PUB dropped it, shows no gap by itself
        diag = (start, pub.sent, pub.send_errors, pub.replays, pub.bad_replays, sub.counters)
        assert [s for s, _ in got] == list(range(start + 1, start + 1 + n)), diag
        assert [b.events[0].block_hashes for _, b in got] == [[h] for h in range(n)]
        assert sub.counters.replayed > 0 and sub.counters.missed == 0  # PUB dropped some
    finally:
        sub.close()
        feed.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-events-replay", "tcp://127.0.0.1:5558"], "--kv-events-replay needs --kv-events"),
    (["--kv-events", "tcp://0.0.0.0:5557"], "refusing to bind tcp://0.0.0.0:5557"),
    (["--kv-events", "tcp://127.0.0.1"], "has no port"),
    (["--kv-events", "udp://x:1"], "not a ZeroMQ endpoint"),
    (["--kv-events", "tcp://127.0.0.1:0", "--kv-events-buffer-steps", "0"], "must be >= 1"),
])
def test_bad_kv_events_options_are_refused_before_loading(argv, message, capsys):
    from kvscope.engine.cli.serve import main

    assert main(["--model", "/nonexistent", *argv]) == 2
    assert message in capsys.readouterr().err
