"""KV beyond the pool: the host and disk tiers behind the prefix cache, and the block manager's
three calls into them.

* offload(block): the block manager evicts a cached (ref count 0, hashed, full) block: its
  content is copied to the host tier first if it has room.
* onboard(seq, ...): a prefix lookup missed the pool: the blocks that follow in the host tier
  (else on disk) are copied into free pool blocks and registered there, as if computed.
* after_step(registered): the blocks a step filled are written through to the disk tier, so a
  conversation outlives the engine (a restart finds its prefix there).

Blocks are found by a content digest chained from the tier key (engine/kv_cache/tier_key.py),
never by the pool's process-local hash; both tiers keep only full, hashed blocks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache.block_copy import BlockIO, PoolBlocks
from kvscope.engine.kv_cache.disk_tier import DiskTier, default_dir
from kvscope.engine.kv_cache.events import BlockCached, BlockUncached, CacheEvent
from kvscope.engine.kv_cache.host_tier import HostEntry, HostTier
from kvscope.engine.kv_cache.pool import KVPool
from kvscope.engine.kv_cache.tier_key import TierKey, chain_digest, tensors_digest
from kvscope.engine.sequence import Sequence
from kvscope.kernels.k_balance import KBalanceLayer

if TYPE_CHECKING:
    from kvscope.engine.kv_cache.block_manager import Block, BlockManager

HOST, DISK = "CPU", "STORAGE"  # vLLM's KV-event media
MAX_MEMO = 1 << 16  # pool hash -> digest entries kept before the memo starts over


@dataclass
class TierEvent:
    """An offload or onboarding, for a trace (engine/traces/recorder.py)."""
    kind: str  # "offload" or "onboard"
    medium: str  # HOST or DISK
    blocks: int
    request_id: str = ""


@dataclass
class TierCounters:
    offloaded_blocks: int = 0  # pool -> host
    onboarded: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})  # blocks
    hit_tokens: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})
    host_evicted_blocks: int = 0


class KVTiers:
    def __init__(self, io: BlockIO, key: TierKey, host_bytes: int, disk_bytes: int,
                 disk_dir: Path | None = None) -> None:
        self.io = io
        self.key = key
        self.key_digest = key.digest
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = (DiskTier(disk_dir or default_dir(), disk_bytes, key, io.layout)
                     if disk_bytes > 0 else None)
        self.counters = TierCounters()
        self.trace_events: list[TierEvent] | None = None  # a list records (the trace does)
        self._digests: dict[int, bytes] = {}  # the pool's chain hash -> content digest
        self._onboarded: dict[int, tuple[bytes, str]] = {}  # block id -> (digest, medium)

    # -- digests ---------------------------------------------------------------------------
    def digest(self, bm: BlockManager, seq: Sequence, i: int) -> bytes:
        """seq's i-th full block's content digest (memoised by the pool's chain hash)."""
        memo = self._digests
        d = memo.get(bm.block_hash(seq, i))
        if d is not None:
            return d
        j = i
        while j > 0 and bm.block_hash(seq, j - 1) not in memo:
            j -= 1
        prev = memo[bm.block_hash(seq, j - 1)] if j > 0 else self.key_digest
        if len(memo) > MAX_MEMO:
            memo.clear()
        for k in range(j, i + 1):
            prev = chain_digest(prev, bm.block_tokens(seq, k))
            memo[bm.block_hash(seq, k)] = prev
        return prev

    # -- the block manager's calls ---------------------------------------------------------
    def offload(self, bm: BlockManager, block: Block, priority: int) -> None:
        """block (cached, ref count 0) is about to be evicted from the pool."""
        host, d = self.host, block.digest
        if host is None or d is None or block.hash is None:
            return
        if d in host:
            host.touch(d, priority)
            return
        entry = HostEntry(self.io.read(block.block_id), block.token_ids, block.hash,
                          self.io.block_nbytes)
        kept, evicted = host.put(d, entry, priority)
        for gone in evicted:
            self.counters.host_evicted_blocks += 1
            self._event(bm, BlockUncached(gone.block_hash, HOST))
        if kept:
            self.counters.offloaded_blocks += 1
            self._event(bm, BlockCached(block.hash, None, block.token_ids, HOST))
            self._trace("offload", HOST, 1)

    def onboard(self, bm: BlockManager, seq: Sequence, hits: list[int], stop: int
                ) -> list[int]:
        """Copy seq's blocks len(hits)..stop-1 that a tier holds into the pool (a run from
        the first; it ends at the first block no tier holds); returns their pool block ids,
        registered and cached-free, for match_prefix to report as hits."""
        plan: list[tuple[int, bytes, str]] = []
        for i in range(len(hits), stop):
            d = self.digest(bm, seq, i)
            if self.host is not None and d in self.host:
                plan.append((i, d, HOST))
            elif self.disk is not None and self.disk.contains(d):
                plan.append((i, d, DISK))
            else:
                break
        if not plan:
            return []
        # The pool hits found so far must not be evicted to make room: out of the order
        # until done. At least one block stays for the tokens still to compute.
        kept = [(b, bm.cached_free.priority_of(b)) for b in hits if b in bm.cached_free]
        for b, _ in kept:
            bm.cached_free.remove(b)
        room = len(bm.free_blocks) + len(bm.cached_free) - 1
        plan = plan[:max(0, room)]
        priority = bm.release_priority(seq)
        pinned = [d for _, d, medium in plan if medium == HOST]
        for d in pinned:
            assert self.host is not None
            self.host.pin(d)
        taken: list[int] = []
        journal, bm.journal = bm.journal, None  # copied, not computed: no step can undo them
        try:
            for i, d, medium in plan:
                block_id = self._load(bm, seq, i, d, medium)
                if block_id is None:
                    break
                taken.append(block_id)
        finally:
            bm.journal = journal
            for d in pinned:
                assert self.host is not None
                self.host.unpin(d, priority)
            for block_id in reversed(taken):  # the tail first, as free() releases
                bm.blocks[block_id].ref_count = 0
                bm.release(bm.blocks[block_id], priority)
            for b, p in kept:
                bm.cached_free.add(b, p)
        for medium in (HOST, DISK):
            n = sum(1 for b in taken if self._onboarded[b][1] == medium)
            if n:
                self.counters.onboarded[medium] += n
                self._trace("onboard", medium, n, seq.request_id)
        return taken

    def _load(self, bm: BlockManager, seq: Sequence, i: int, d: bytes, medium: str
              ) -> int | None:
        tokens = bm.block_tokens(seq, i)
        if medium == HOST:
            assert self.host is not None
            payload: list[torch.Tensor] | None = self.host.entries[d].payload
        else:
            assert self.disk is not None
            payload = self.disk.get(d, tokens)
        if payload is None:
            return None
        block_id = bm.pop_free_block()  # its victim is never a planned or hit block
        self.io.write(block_id, payload)
        block = bm.blocks[block_id]
        bm.register(block, bm.block_hash(seq, i), tokens,
                    bm.block_hash(seq, i - 1) if i else None)
        if block.hash is None:  # a hash collision with another prefix: not ours to share
            block.ref_count = 0
            bm.release(block)
            return None
        block.digest = d
        self._onboarded[block_id] = (d, medium)
        return block_id

    def on_allocate(self, bm: BlockManager, seq: Sequence, hits: list[int]) -> None:
        """seq took these prefix hits: count the tokens each tier supplied."""
        counts = {HOST: 0, DISK: 0}
        for b in hits:
            src = self._onboarded.pop(b, None)
            if src is not None and src[0] == bm.blocks[b].digest:
                counts[src[1]] += bm.block_size
        seq.num_host_cached_tokens = counts[HOST]
        seq.num_disk_cached_tokens = counts[DISK]
        for medium, n in counts.items():
            self.counters.hit_tokens[medium] += n

    def after_step(self, bm: BlockManager, registered: list[int]) -> None:
        """The step that filled these (newly registered) blocks ran: write them through to
        disk."""
        disk = self.disk
        if disk is None or disk.writes_stopped:
            return
        for block_id in registered:
            block = bm.blocks[block_id]
            d = block.digest
            if d is None or block.hash is None or disk.contains(d):
                continue
            if disk.put(d, block.token_ids, self.io.read_now(block_id)):
                self._event(bm, BlockCached(block.hash, None, block.token_ids, DISK))

    # -- views -----------------------------------------------------------------------------
    def stats_fields(self) -> dict[str, Any]:  # ints, for EngineStats(**...)
        """The tiers' part of EngineStats (ipc.messages)."""
        c, host, disk = self.counters, self.host, self.disk
        return {
            "kv_host_blocks": len(host) if host else 0,
            "kv_host_bytes": host.nbytes if host else 0,
            "kv_host_capacity_bytes": host.capacity_bytes if host else 0,
            "kv_host_capacity_blocks": host.capacity_bytes // max(1, self.io.block_nbytes)
            if host else 0,
            "kv_disk_blocks": len(disk) if disk else 0,
            "kv_disk_bytes": disk.nbytes if disk else 0,
            "kv_disk_capacity_bytes": disk.capacity_bytes if disk else 0,
            "kv_offloaded_blocks": c.offloaded_blocks,
            "kv_offloaded_bytes": c.offloaded_blocks * self.io.block_nbytes,
            "kv_onboarded_host_blocks": c.onboarded[HOST],
            "kv_onboarded_disk_blocks": c.onboarded[DISK],
            "kv_onboarded_bytes": (c.onboarded[HOST] + c.onboarded[DISK]) * self.io.block_nbytes,
            "kv_disk_written_blocks": disk.num_written if disk else 0,
            "kv_disk_refused_blocks": sum(disk.refused.values()) if disk else 0,
            "prefix_cache_hits_host": c.hit_tokens[HOST],
            "prefix_cache_hits_disk": c.hit_tokens[DISK],
        }

    def _event(self, bm: BlockManager, event: CacheEvent) -> None:
        if bm.cache_events is not None:
            bm.cache_events.append(event)

    def _trace(self, kind: str, medium: str, blocks: int, request_id: str = "") -> None:
        if self.trace_events is not None:
            self.trace_events.append(TierEvent(kind, medium, blocks, request_id))


# -- building them for a pool ----------------------------------------------------------------
def model_identity(checkpoint: Path, config_json: str) -> str:
    """The checkpoint's path, its config and its weight files' names, sizes and mtimes: a
    changed or re-converted checkpoint is another model to the tiers."""
    path = Path(checkpoint).resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".pt"))
    parts = [str(path), tensors_digest([config_json.encode()])]
    for p in files:
        st = os.stat(p)
        parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def tiers_for(config: EngineConfig, pool: KVPool, identity: str, model_dtype: str,
              weights: str, device: str, kv_dtype: str, rotation: str) -> KVTiers | None:
    """The tiers config asks for, over this pool; None when both are off."""
    if config.kv_offload_bytes <= 0 and config.kv_disk_bytes <= 0:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("EngineConfig.kv_offload_bytes/kv_disk_bytes need prefix caching: "
                         "the tiers keep the prefix cache's blocks")
    if pool.anchors is not None:  # config.validate refuses it; never tier a pool with anchors
        raise ValueError("KV tiers cannot carry anchor tokens; set kv_anchor_tokens=0")
    io = PoolBlocks.of(pool)
    first = pool.caches[0][0]
    key = TierKey(model=identity, model_dtype=model_dtype, weights=weights,
                  device_type=torch.device(device).type, kv_dtype=kv_dtype,
                  block_size=pool.block_size, num_layers=len(pool.caches),
                  num_kv_heads=first.shape[2], head_dim=first.shape[3], rotation=rotation,
                  calibration=calibration_digest(pool.k_balance))
    return KVTiers(io, key, config.kv_offload_bytes, config.kv_disk_bytes,
                   Path(config.kv_disk_dir) if config.kv_disk_dir else None)


def calibration_digest(k_balance: list[KBalanceLayer] | None) -> str:
    if k_balance is None:
        return ""
    return tensors_digest([_raw(t) for kb in k_balance for t in (kb.shift, kb.gain)])


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().float().cpu().contiguous().numpy().tobytes()

