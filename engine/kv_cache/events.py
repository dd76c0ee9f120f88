"""What happened to the prefix cache, as the block manager records it for whoever listens.

The block manager appends these to its `cache_events` list when someone asked it to (the
list is None otherwise, so recording costs nothing when nobody listens). The server drains the
list after each step and publishes it in vLLM's KV-event format (engine/server/kv_events.py);
the core never knows that.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockCached:
    """A full block's content hash entered the prefix cache."""

    block_hash: int
    parent_hash: int | None  # the hash of the block before it in the sequence; None for the first
    token_ids: tuple[int, ...]
    # Where it is stored, in vLLM's terms ("CPU" host tier, "STORAGE" disk tier;
    # engine/kv_cache/tiers.py); None: the pool itself.
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockUncached:
    """A hash left the prefix cache: its block was evicted for reuse, or the cache was reset."""

    block_hash: int
    medium: str | None = None  # as BlockCached's


CacheEvent = BlockCached | BlockUncached
