"""Paged KV bookkeeping: the free lists, block tables, ref counts and the prefix cache.

A block is in exactly one of three states: in use (ref_count > 0), cached-free (ref_count 0 but its
content hash is still registered, so a later request with the same prefix can take it back) or free.
Allocation prefers free blocks and only then evicts cached-free ones, those released by the least
urgent requests first, then the least recently released (engine/kv_cache/evictable_blocks.py), so
the prefix cache lives as long as memory allows. Beyond the pool, optional host and disk tiers
keep evicted blocks and give them back by copy (engine/kv_cache/tiers.py)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvscope.engine.kv_cache.events import BlockCached, BlockUncached, CacheEvent
from kvscope.engine.kv_cache.evictable_blocks import CachedFree
from kvscope.engine.kv_cache.tier_hook import TierHook
from kvscope.engine.sequence import Sequence

# A block-table entry whose block was released because it lies wholly behind a sliding
# window (free_behind_window): the table keeps its length, so logical block i still covers
# tokens [i * block_size, (i + 1) * block_size), and every reader skips these entries.
FREED = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    # The tiers' content digest (engine/kv_cache/tiers.py) of a registered block; None
    # without tiers.
    digest: bytes | None = None


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block that also covers everything before it (so equal hash = equal prefix)."""
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached_free = CachedFree()
        # Whether a released block's eviction waits on its releaser's priority (the scheduler
        # sets it under the priority policy; otherwise least recently released first).
        self.evict_by_priority = False
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.cache_events: list[CacheEvent] | None = None  # a list records (cache_events.py)
        # Blocks whose hash was registered since the journal opened (a list records): the
        # scheduler registers a chunk's blocks before the step runs, so a step abandoned
        # midway (engine.model.step_interrupt) must forget them again.
        self.journal: list[int] | None = None
        # The host and disk tiers behind the prefix cache (engine/kv_cache/tiers.py): an
        # evicted cached block goes there, a prefix lookup that misses here looks there.
        self.tiers: TierHook | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: truly free plus evictable cached ones."""
        return len(self.free_blocks) + len(self.cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    # -- prefix cache ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq, without taking them.

        At least one token is always left to compute, because the step needs the logits of
        the last one. With tiers, the blocks a tier holds after the last pool hit are copied
        into the pool first (registered and cached-free, as if computed: tiers.onboard).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block.get(self.block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != self.block_tokens(seq, i):
                break
            hits.append(block_id)
        else:
            return hits
        if self.tiers is not None:
            hits += self.tiers.onboard(self, seq, hits, (seq.num_tokens - 1) // self.block_size)
        return hits

    def block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of seq's i-th full block; memoised because full blocks never change."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            prev = seq.block_hashes[-1] if j else None
            seq.block_hashes.append(chain_hash(prev, self.block_tokens(seq, j)))
        return seq.block_hashes[i]

    def block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def can_allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether seq (with no blocks yet) can take its prefix hits and num_new_tokens slots."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        total = self.blocks_for_tokens(len(hits) * self.block_size + num_new_tokens)
        return total - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Give a newly admitted seq its shared prefix blocks plus fresh ones for its chunk."""
        assert not seq.block_table, "allocate() is for a sequence that holds no blocks"
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        for block_id in hits:
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.tiers is not None:
            self.tiers.on_allocate(self, seq, hits)
        self.append_slots(seq, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        self.append_blocks(seq, self.num_new_blocks(seq, num_new_tokens))

    def append_blocks(self, seq: Sequence, count: int) -> None:
        for _ in range(count):
            seq.block_table.append(self.pop_free_block())

    def commit_full_blocks(self, seq: Sequence, num_computed_before: int,
                           num_computed_after: int | None = None) -> None:
        """Register the content hash of blocks that are full once the step has run.

        The scheduler calls this when it schedules the chunk, not after the step: a request
        admitted in the same step can then share them, which is safe because each layer writes
        the whole step's K/V before any attention of that layer reads the pool.
        """
        if not self.enable_prefix_caching:
            return
        end = seq.num_computed_tokens if num_computed_after is None else num_computed_after
        for i in range(num_computed_before // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            parent = self.block_hash(seq, i - 1) if i else None
            self.register(block, self.block_hash(seq, i), self.block_tokens(seq, i), parent)
            if self.tiers is not None and block.hash is not None and block.digest is None:
                block.digest = self.tiers.digest(self, seq, i)

    def register(self, block: Block, block_hash: int, tokens: tuple[int, ...],
                 parent: int | None = None) -> None:
        if block.hash is not None:
            return  # a shared prefix block, registered by whoever computed it
        block.token_ids = tokens
        if block_hash not in self.hash_to_block:
            block.hash = block_hash
            self.hash_to_block[block_hash] = block.block_id
            if self.journal is not None:
                self.journal.append(block.block_id)
            if self.cache_events is not None:
                self.cache_events.append(BlockCached(block_hash, parent, tokens))
        # else: the same content was computed twice concurrently; this copy stays private.

    # -- release ---------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks are released first so they are evicted first."""
        priority = self.release_priority(seq)
        for block_id in reversed(seq.block_table):
            if block_id == FREED:
                break  # freed entries are a prefix of the table: nothing before is held
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.release(block, priority)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def free_behind_window(self, seq: Sequence, window: int) -> list[int]:
        """Release seq's blocks that no query of its coming step can see, and mark their
        table entries FREED; returns the released block ids (latest first).

        A query at position p attends keys j > p - window, and the coming step's first query
        sits at num_computed_tokens, so every key before num_computed_tokens - window + 1 is
        dead for good. Call it before the scheduler allocates for the step, so the blocks are
        reusable at once. Shared prefix blocks only lose this reference; a hashed block goes
        to the cached-free list like any other released block.
        """
        if window <= 0:
            return []
        table = seq.block_table
        dead = min(max(0, seq.num_computed_tokens - window + 1) // self.block_size, len(table))
        released: list[int] = []
        priority = self.release_priority(seq)
        # Freed entries form a prefix, so walking back from the last dead one stops at once
        # in the common case (one new dead block every block_size steps, or none).
        i = dead - 1
        while i >= 0 and table[i] != FREED:
            block_id = table[i]
            table[i] = FREED
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.release(block, priority)
            released.append(block_id)
            i -= 1
        return released

    def truncate(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Release seq's blocks past its first num_blocks (rejected speculative slots);
        returns the released block ids, latest first."""
        released: list[int] = []
        table = seq.block_table
        priority = self.release_priority(seq)
        while len(table) > num_blocks:
            block_id = table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.release(block, priority)
            released.append(block_id)
        return released

    def forget_registered(self, block_ids: list[int]) -> None:
        """Unregister these blocks' hashes (their step never ran): nobody may hit them."""
        for block_id in block_ids:
            self._forget(self.blocks[block_id])
            if block_id in self.cached_free:  # freed since: with no hash it is plain free
                self.cached_free.remove(block_id)
                self.free_blocks.append(block_id)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached_free):
            self._forget(self.blocks[block_id])
            self.free_blocks.append(block_id)
        self.cached_free.clear()

    # -- internals -------------------------------------------------------------------------
    def release_priority(self, seq: Sequence) -> int:
        """Where seq's released blocks go in the eviction order
        (engine/kv_cache/evictable_blocks.py)."""
        return seq.params.priority if self.evict_by_priority else 0

    def release(self, block: Block, priority: int = 0) -> None:
        if block.hash is not None:
            self.cached_free.add(block.block_id, priority)
        else:
            block.token_ids = ()
            self.free_blocks.append(block.block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.cached_free.remove(block_id)
        block.ref_count += 1

    def pop_free_block(self) -> int:
        if self.free_blocks:
            block_id = self.free_blocks.popleft()
        else:
            if self.tiers is not None:  # copied out before its slot is reused
                self.tiers.offload(self, self.blocks[self.cached_free.victim()],
                                   self.cached_free.victim_priority())
            block_id = self.cached_free.pop_victim()
            self._forget(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
            if self.cache_events is not None:
                self.cache_events.append(BlockUncached(block.hash))
        block.hash, block.token_ids, block.digest = None, (), None
