"""What a preemption records, and whether preempting some requests would make room.

Preemption is by recompute: the victim's blocks are freed and it waits to be admitted again,
when its prompt and its tokens so far are computed anew (minus what the prefix cache still
holds). Reasons: "memory" (the pool ran dry under a running request) and "priority" (a waiting
request of strictly higher priority displaced it).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.sequence import Sequence

REASONS = ("memory", "priority")


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    reason: str  # one of REASONS
    block_ids: tuple[int, ...]  # its block table as it was freed (-1: freed behind a window)
    priority: int


def blocks_needed(bm: BlockManager, hits: list[int], num_new_tokens: int) -> int:
    """Free blocks a sequence with no blocks yet lacks to take its hits and a chunk of
    num_new_tokens (BlockManager.can_allocate's arithmetic; <= 0: it fits)."""
    revived = sum(1 for b in hits if bm.blocks[b].ref_count == 0)
    total = bm.blocks_for_tokens(len(hits) * bm.block_size + num_new_tokens)
    return total - len(hits) + revived - bm.num_free_blocks


def blocks_released(bm: BlockManager, victim: Sequence, keep: set[int],
                    refs: dict[int, int]) -> int:
    """Blocks that freeing victim, after the victims already counted in refs (block ->
    references left), would return to the pool, not counting those in keep (the newcomer's
    prefix hits: freeing one of those makes it free and revived at once)."""
    released = 0
    for b in victim.block_table:
        if b < 0:  # freed behind a sliding window already
            continue
        left = refs.get(b, bm.blocks[b].ref_count) - 1
        refs[b] = left
        if left == 0 and b not in keep:
            released += 1
    return released
