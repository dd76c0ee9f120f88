"""The blocks frame's hash tags: one per prefix-cached block, lined up with its flags."""
from __future__ import annotations

import msgspec
import numpy as np

from kvscope.engine.server.snapshots import blocks_frame
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from tests.ipc.test_messages import fake_engine


def decoded(engine, seq=1):
    return msgspec.msgpack.decode(codec.encode(blocks_frame(engine, seq=seq)),
                                  type=m.BlocksFrame)


def test_tags_are_each_hashed_blocks_content_hash():
    engine = fake_engine()
    bm = engine.block_manager
    tags = decoded(engine).block_tags()
    hashed = [b for b in bm.blocks if b.hash is not None]
    assert len(hashed) >= 3  # a shared prefix block, "b"'s own full block, cached ones
    for b in bm.blocks:
        want = -1 if b.hash is None else b.hash & 0xFFFFFFFF
        assert tags[b.block_id] == want, b
    # Different content, different tags (a viewer compares them across frames).
    assert len({int(tags[b.block_id]) for b in hashed}) == len(hashed)


def test_an_evicted_and_refilled_block_changes_its_tag():
    engine = fake_engine()
    bm = engine.block_manager
    before = decoded(engine).block_tags()
    cached = list(bm.cached_free)
    block = bm.blocks[cached[0]]
    bm._forget(block)  # evicted, as pop_free_block does
    bm.register(block, hash(("other content",)), (1, 2, 3, 4))
    after = decoded(engine, 2).block_tags()
    assert after[block.block_id] != before[block.block_id] != -1
    others = np.arange(bm.num_blocks) != block.block_id
    assert (after[others] == before[others]).all()


def test_frames_without_tags_decode_and_say_nothing():
    frame = decoded(fake_engine())
    old = msgspec.structs.replace(frame, hash_tags=b"")  # a sender from before protocol 3
    assert (old.block_tags() == -1).all()
    torn = msgspec.structs.replace(frame, hash_tags=frame.hash_tags[:-1])
    assert (torn.block_tags() == -1).all()
