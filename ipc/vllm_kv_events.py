"""vLLM's KV-cache event schema and wire framing, written out here so both sides share one copy.

`kvscope serve --kv-events` encodes with these structs and the window decodes a vLLM server's
stream with them. Field names, order, defaults and struct options are those of
`vllm/distributed/kv_events.py` (vLLM main, the same as v0.28.0 for every field kvscope sets):
the batch is a msgpack array `[ts, events, data_parallel_rank]`, each event a msgpack map tagged
by `"type"` ("BlockStored", "BlockRemoved", "AllBlocksCleared"), defaults omitted. So vLLM's
own `msgspec.msgpack.Decoder(KVEventBatch)` reads kvscope's bytes, and so do the KV-aware
routers that consume vLLM's stream (llm-d, Dynamo).

Framing (ZmqEventPublisher): PUB multipart `(topic, seq as 8-byte big-endian, payload)`;
the replay ROUTER answers an 8-byte big-endian start seq with `(seq, payload)` for every
buffered batch from there, then `(END_SEQ, b"")`.

Older vLLM releases (before vllm-project/vllm#42892) sent each event as a positional array
instead of a map; `decode_batch` reads both, so the window can watch either.
"""
from __future__ import annotations

from typing import Any

import msgspec

# vLLM sends sha256 bytes, or ints under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; kvscope sends ints.
ExternalBlockHash = bytes | int
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; the tag is the class name, under the key "type"."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: block_hashes[0]'s parent is parent_block_hash,
    each later hash's parent is the one before it; token_ids are all their tokens in order."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """These hashes left the prefix cache (evicted, or the cache was reset)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the cache at once (kvscope: the KV pool was rebuilt)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


# -- older vLLM: events as positional arrays -----------------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ArrayKVEvent = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared


class _ArrayEventBatch(EventBatch):
    events: list[_ArrayKVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_ArrayEventBatch)


class BadEventBatch(ValueError):
    """A payload that is not a vLLM KV-event batch in either encoding."""


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from either encoding, as the current structs; BadEventBatch says what is wrong."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as current:
        try:
            old = _array_decoder.decode(payload)
        except msgspec.DecodeError:
            raise BadEventBatch(f"not a vLLM KV-event batch: {current}") from None
    return KVEventBatch(old.ts, [_upgrade(e) for e in old.events], old.data_parallel_rank)


def _upgrade(event: _ArrayKVEvent) -> KVEvent:
    if isinstance(event, _ArrayBlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids,
                           event.block_size, event.lora_id, event.medium, event.lora_name)
    if isinstance(event, _ArrayBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadEventBatch(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
