"""The prefix cache's evictable blocks (ref count 0, content still registered), in the order
an allocation takes them: those released by the least urgent requests first, then the least
recently released.

Under the priority policy a chat's cached prompt blocks (its chat template and earlier turns)
are then the last the background's allocations evict: on a 2-core CPU beside 16 background
streams the chat otherwise found only one of its two prefix blocks again and computed 22
prompt tokens where idle it computed 6, its TTFT p99 at 1.5x idle (docs/scheduling.md).
Every cached-free block stays evictable, so the pool's capacity is unchanged.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class CachedFree:
    """Block ids by the priority of the request that released them (lower = more urgent)."""

    def __init__(self) -> None:
        self._by_priority: dict[int, OrderedDict[int, None]] = {}
        self._priority_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._priority_of

    def __iter__(self) -> Iterator[int]:
        """In eviction order."""
        for priority in sorted(self._by_priority, reverse=True):
            yield from self._by_priority[priority]

    def add(self, block_id: int, priority: int = 0) -> None:
        self._priority_of[block_id] = priority
        self._by_priority.setdefault(priority, OrderedDict())[block_id] = None

    def remove(self, block_id: int) -> None:
        priority = self._priority_of.pop(block_id)
        blocks = self._by_priority[priority]
        del blocks[block_id]
        if not blocks:
            del self._by_priority[priority]

    def priority_of(self, block_id: int) -> int:
        return self._priority_of[block_id]

    def victim(self) -> int:
        """The block pop_victim() would take, left in place (KeyError when none)."""
        return next(iter(self._by_priority[self.victim_priority()]))

    def victim_priority(self) -> int:
        if not self._by_priority:
            raise KeyError("no cached-free block to evict")
        return max(self._by_priority)

    def pop_victim(self) -> int:
        """The block an allocation evicts: the least urgent releaser's, least recent first
        (KeyError when there is none, as an empty free list's)."""
        if not self._by_priority:
            raise KeyError("no cached-free block to evict")
        priority = max(self._by_priority)
        blocks = self._by_priority[priority]
        block_id, _ = blocks.popitem(last=False)
        if not blocks:
            del self._by_priority[priority]
        del self._priority_of[block_id]
        return block_id

    def clear(self) -> None:
        self._by_priority.clear()
        self._priority_of.clear()
