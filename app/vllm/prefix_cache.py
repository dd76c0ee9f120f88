"""The prefix cache of a vLLM server as its KV events describe it: content hashes, their chains
and their tokens, never physical block ids (vLLM does not send those).

Fed in sequence order by the event worker; `snapshot()` gives the window a copy to draw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.ipc import vllm_kv_events as v


@dataclass
class CachedBlock:
    parent: bytes | int | None
    root: bytes | int  # the first block of its chain that this map knows
    depth: int  # blocks before it in the chain (as far as known)
    num_tokens: int


@dataclass(frozen=True)
class CacheSnapshot:
    roots: list[int]  # per cached block, in insertion order: a small id of its chain's root
    depths: list[int]
    num_blocks: int
    num_tokens: int
    num_chains: int
    longest_chain: int
    stored_total: int
    removed_total: int
    cleared_total: int
    unknown_removed: int  # removals of hashes stored before the window attached
    block_size: int | None
    mediums: tuple[str, ...]


@dataclass
class PrefixCache:
    blocks: dict[bytes | int, CachedBlock] = field(default_factory=dict)
    stored_total: int = 0
    removed_total: int = 0
    cleared_total: int = 0
    unknown_removed: int = 0
    block_size: int | None = None
    mediums: set[str] = field(default_factory=set)

    def apply(self, batch: v.KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, v.BlockStored):
                self._stored(event)
            elif isinstance(event, v.BlockRemoved):
                for h in event.block_hashes:
                    if self.blocks.pop(h, None) is None:
                        self.unknown_removed += 1
                    self.removed_total += 1
            elif isinstance(event, v.AllBlocksCleared):
                self.blocks.clear()
                self.cleared_total += 1

    def _stored(self, event: v.BlockStored) -> None:
        self.block_size = event.block_size
        if event.medium:
            self.mediums.add(event.medium)
        parent = event.parent_block_hash
        n = len(event.block_hashes)
        per_block = len(event.token_ids) // n if n else 0
        for h in event.block_hashes:
            known = self.blocks.get(parent) if parent is not None else None
            root = known.root if known else (h if parent is None else parent)
            depth = known.depth + 1 if known else (0 if parent is None else 1)
            self.blocks[h] = CachedBlock(parent, root, depth, per_block)
            self.stored_total += 1
            parent = h

    def snapshot(self) -> CacheSnapshot:
        ids: dict[bytes | int, int] = {}
        roots, depths = [], []
        for b in self.blocks.values():
            roots.append(ids.setdefault(b.root, len(ids)))
            depths.append(b.depth)
        return CacheSnapshot(roots, depths, len(self.blocks),
                             sum(b.num_tokens for b in self.blocks.values()), len(ids),
                             max(depths, default=-1) + 1, self.stored_total, self.removed_total,
                             self.cleared_total, self.unknown_removed, self.block_size,
                             tuple(sorted(self.mediums)))
