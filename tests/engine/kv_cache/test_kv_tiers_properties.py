"""BlockManager + KV tiers under random interleavings of allocate / free / evict / offload / onboard
/ reconfigure / restart / a corrupted disk file, without a model.

The pool is a shadow (tests/engine/kv_cache/test_block_manager.ShadowKV: each slot holds a hash
of the prefix ending there) and the tiers copy it through a BlockIO of their own, whose payload
also carries a tag of the tier key it was read under. So a block onboarded with the wrong
content, or from another configuration (a stale block), reads back wrong; a block lost or
owned twice breaks the pool's invariants; and the tiers' byte budgets and file index are
checked after every rule.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.kv_cache.disk_tier import HEADER
from kvscope.engine.kv_cache.tier_key import TierKey
from kvscope.engine.kv_cache.tiers import KVTiers
from kvscope.engine.sequence import Sequence
from tests.engine.kv_cache.test_block_manager import ShadowKV, check_invariants, compute, make_seq

PREFIXES = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5, 8, 13, 21, 34])


class ShadowBlocks:
    """BlockIO over the shadow pool: one int64 per slot, then the key's tag."""

    def __init__(self, shadow: ShadowKV, block_size: int, tag: int) -> None:
        self.shadow, self.block_size, self.tag = shadow, block_size, tag
        self.layout = [((block_size + 1,), torch.int64)]
        self.block_nbytes = 8 * (block_size + 1)

    def read(self, block_id: int) -> list[torch.Tensor]:
        slots = [self.shadow.slots.get((block_id, o), 0) for o in range(self.block_size)]
        return [torch.tensor([*slots, self.tag], dtype=torch.int64)]

    read_now = read

    def write(self, block_id: int, payload: list[torch.Tensor]) -> None:
        *slots, tag = payload[0].tolist()
        assert tag == self.tag, "a block read under another tier key was onboarded"
        for o, value in enumerate(slots):
            self.shadow.slots[(block_id, o)] = value


def key_of(block_size: int, kv_dtype: str) -> TierKey:
    return TierKey("sim", "float32", "dense", "cpu", kv_dtype, block_size, 1, 1, 1, "none", "")


class TierMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), pool_tokens=st.integers(12, 28),
                host_tokens=st.integers(0, 32), disk_tokens=st.integers(0, 48))
    def setup(self, block_size, pool_tokens, host_tokens, disk_tokens):
        """Sizes in tokens, so that every block size sees the same pressure: a pool of about
        two prompts, where a third evicts some prefix."""
        self.dir = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
        self.pool_tokens, self.host_tokens, self.disk_tokens = pool_tokens, host_tokens, \
            disk_tokens
        self.kv_dtype = "float32"
        self.live: list[Sequence] = []
        self.onboarded = 0  # prefix tokens the tiers gave back, over the run
        self.build(block_size)

    def build(self, block_size: int) -> None:
        """A new pool (a restart or a rebuild): nothing of the old one survives but the disk."""
        self.live = []
        self.bm = BlockManager(max(2, self.pool_tokens // block_size), block_size,
                               enable_prefix_caching=True)
        self.shadow = ShadowKV(self.bm)
        key = key_of(block_size, self.kv_dtype)
        tag = int.from_bytes(hashlib.sha256(key.to_json().encode()).digest()[:7], "little")
        io = ShadowBlocks(self.shadow, block_size, tag)
        file_bytes = HEADER.size + len(key.to_json()) + 8 * block_size + io.block_nbytes
        self.bm.tiers = KVTiers(io, key, self.host_tokens // block_size * io.block_nbytes,
                                self.disk_tokens // block_size * file_bytes, self.dir)

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(turns=st.lists(st.tuples(st.integers(0, len(PREFIXES)), st.integers(4, 9),
                                   st.lists(st.integers(0, 3), min_size=1, max_size=6)),
                         min_size=1, max_size=4),
          keep=st.integers(0, 2))
    def churn(self, turns, keep):
        """Requests arrive one after another; all but the `keep` latest finish."""
        for prefix, cut, suffix in turns:
            self.admit((list(PREFIXES[prefix][:cut]) if prefix < len(PREFIXES) else []) + suffix)
            while len(self.live) > keep:
                self.bm.free(self.live.pop(0))

    def admit(self, tokens: list[int]) -> None:
        bm = self.bm
        if len(tokens) + 1 > bm.num_blocks * bm.block_size:
            return
        seq = make_seq(tokens)
        bm.journal = []
        hits = bm.match_prefix(seq)
        n = seq.num_tokens - len(hits) * bm.block_size
        if not bm.can_allocate(seq, hits, n):
            bm.journal = None
            return
        bm.allocate(seq, hits, n)
        self.onboarded += seq.num_host_cached_tokens + seq.num_disk_cached_tokens
        self.shadow.write(seq, seq.num_computed_tokens, seq.num_tokens)  # the "model"
        compute(bm, seq, n)
        registered, bm.journal = bm.journal, None
        bm.tiers.after_step(bm, registered)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)

    @rule(now=st.integers(0, 3))
    def restart(self, now):
        if now == 0:  # one in four: a restart ends everything the pool held
            self.build(self.bm.block_size)

    @rule(now=st.integers(0, 3), block_size=st.sampled_from([1, 2, 4]),
          kv_dtype=st.sampled_from(["float32", "int8"]))
    def reconfigure(self, now, block_size, kv_dtype):
        if now == 0:
            self.kv_dtype = kv_dtype
            self.build(block_size)

    @rule(which=st.integers(0, 100), at=st.integers(1, 40))
    def corrupt_a_disk_file(self, which, at):
        files = sorted(self.dir.glob("*.kvb"))
        if not files:
            return
        path = files[which % len(files)]
        raw = bytearray(path.read_bytes())
        raw[-1 - at % (8 * (self.bm.block_size + 1))] ^= 0x20  # in its K/V bytes
        path.write_bytes(bytes(raw))

    @invariant()
    def pool_is_consistent_and_every_slot_reads_its_prefix(self):
        check_invariants(self.bm, self.live)
        self.shadow.check(self.live)

    @invariant()
    def tiers_stay_in_their_budgets(self):
        tiers = self.bm.tiers
        host, disk = tiers.host, tiers.disk
        if host is not None:
            assert host.nbytes == sum(e.nbytes for e in host.entries.values())
            assert host.nbytes <= host.capacity_bytes
            assert len(host._order) == len(host.entries)  # nothing left pinned
        if disk is not None:
            assert disk.nbytes <= disk.capacity_bytes
            assert sorted(p.name for p in self.dir.glob("*.kvb")) == sorted(disk.index)
        for block in self.bm.blocks:  # a registered block carries its tiers' digest
            if block.hash is not None:
                assert block.digest is not None


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
