"""The host-memory tier: full, hashed KV blocks the pool evicted, kept in host memory by content.

Bounded in bytes. It evicts in the pool's own order (engine/kv_cache/evictable_blocks.py):
blocks released by the least urgent requests first, then the least recently used, so a chat's
prompt outlives the background's here too. An entry being copied back into the pool is
pinned (out of the eviction order) until the copy is issued, so the evictions that copy
causes can never take it.

On CUDA an entry's tensors are pinned host memory filled by asynchronous copies on the
compute stream (engine/kv_cache/block_copy.py); on the CPU they are ordinary tensors. The
tier never looks inside them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvscope.engine.kv_cache.evictable_blocks import CachedFree


@dataclass
class HostEntry:
    payload: list[torch.Tensor]  # the block's tensors, in block_copy.block_tensors' order
    token_ids: tuple[int, ...]
    block_hash: int  # the pool's chain hash when it was offloaded (KV events name blocks by it)
    nbytes: int


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self.entries: dict[bytes, HostEntry] = {}
        self._slot_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._order = CachedFree()  # slot ids in eviction order (pinned ones absent)
        self._slots = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, digest: object) -> bool:
        return digest in self.entries

    def put(self, digest: bytes, entry: HostEntry, priority: int = 0
            ) -> tuple[bool, list[HostEntry]]:
        """Keep entry under digest, evicting what the bytes need; returns whether it is kept
        and what was evicted for it. Nothing is evicted when it cannot fit in any case."""
        if digest in self.entries:
            self.touch(digest, priority)
            return True, []
        if entry.nbytes > self.capacity_bytes - self._pinned_bytes():
            return False, []
        evicted: list[HostEntry] = []
        while self.nbytes + entry.nbytes > self.capacity_bytes:
            evicted.append(self._evict())
        slot = next(self._slots)
        self.entries[digest] = entry
        self._slot_of[digest] = slot
        self._digest_of[slot] = digest
        self._order.add(slot, priority)
        self.nbytes += entry.nbytes
        return True, evicted

    def touch(self, digest: bytes, priority: int = 0) -> None:
        """Used again: last in its priority's eviction order (a pinned entry stays pinned)."""
        slot = self._slot_of[digest]
        if slot in self._order:
            self._order.remove(slot)
            self._order.add(slot, priority)

    def pin(self, digest: bytes) -> HostEntry:
        """Out of the eviction order until unpin()."""
        slot = self._slot_of[digest]
        if slot in self._order:
            self._order.remove(slot)
        return self.entries[digest]

    def unpin(self, digest: bytes, priority: int = 0) -> None:
        slot = self._slot_of.get(digest)
        if slot is not None and slot not in self._order:
            self._order.add(slot, priority)

    def clear(self) -> list[HostEntry]:
        gone = list(self.entries.values())
        self.entries.clear()
        self._slot_of.clear()
        self._digest_of.clear()
        self._order.clear()
        self.nbytes = 0
        return gone

    def _evict(self) -> HostEntry:
        slot = self._order.pop_victim()
        digest = self._digest_of.pop(slot)
        del self._slot_of[digest]
        entry = self.entries.pop(digest)
        self.nbytes -= entry.nbytes
        return entry

    def _pinned_bytes(self) -> int:
        pinned = len(self.entries) - len(self._order)
        if not pinned:
            return 0
        return sum(self.entries[d].nbytes for d, s in self._slot_of.items()
                   if s not in self._order)
