"""BlockManager: allocation round trips, the prefix cache, exact capacity checks, LRU eviction.

The property tests drive the manager through allocate / compute a chunk / commit the blocks it
filled / append slots for the next chunk / free, and keep a shadow of what each KV slot holds,
so sharing a block that holds the wrong prefix, or reusing a block that someone still reads,
shows up as a wrong value read back. (The scheduler commits a chunk's blocks when it schedules
it, see test_commit_at_schedule_time_lets_a_same_step_arrival_share; here the chunk is computed
right after it is reserved, so committing after computing is equivalent.)
"""
from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.kv_cache.block_manager import BlockManager, chain_hash
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(f"s{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens))


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Mark num_tokens of seq computed (slots already allocated) and commit the full blocks."""
    before = seq.num_computed_tokens
    seq.num_computed_tokens += num_tokens
    assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
    bm.commit_full_blocks(seq, before)


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq with its prefix hits and compute its whole prompt in one chunk."""
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size
    assert bm.can_allocate(seq, hits, n)
    bm.allocate(seq, hits, n)
    compute(bm, seq, n)
    return hits


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """The structural invariants of the pool, given the sequences that hold blocks."""
    n = bm.num_blocks
    free = list(bm.free_blocks)
    cached = list(bm.cached_free)
    in_use = [b.block_id for b in bm.blocks if b.ref_count > 0]
    assert len(free) == len(set(free)), f"duplicate in free_blocks: {free}"
    everything = free + cached + in_use
    assert sorted(everything) == list(range(n)), \
        f"free {free} / cached {cached} / in use {in_use} do not partition range({n})"
    assert bm.num_free_blocks == len(free) + len(cached)
    assert all(b.ref_count >= 0 for b in bm.blocks)
    for b in free:
        assert bm.blocks[b].hash is None, f"free block {b} still has a hash"
    for b in cached:
        h = bm.blocks[b].hash
        assert h is not None and bm.hash_to_block.get(h) == b, \
            f"cached-free block {b} is not registered under its hash"
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].hash == h, f"hash_to_block maps to block {b} that has another hash"
        assert b not in bm.free_blocks

    holders: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in live:
        assert len(seq.block_table) == len(set(seq.block_table)), "a table repeats a block"
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        for i, b in enumerate(seq.block_table):
            holders.setdefault(b, []).append((seq, i))
    for block in bm.blocks:
        held = holders.get(block.block_id, [])
        assert block.ref_count == len(held), \
            f"block {block.block_id}: ref_count {block.ref_count} but in {len(held)} tables"
        if len(held) > 1:
            # Only a registered, fully computed prefix block may be shared, and only at the same
            # position of sequences that agree on everything up to the end of it.
            assert block.hash is not None, f"unregistered block {block.block_id} is shared"
        if block.hash is not None:
            for seq, i in held:
                end = (i + 1) * bm.block_size
                assert seq.num_computed_tokens >= end, \
                    f"registered block {block.block_id} is not fully computed in {seq.request_id}"
                assert block.token_ids == tuple(seq.token_ids[i * bm.block_size:end])
                assert bm.block_hash(seq, i) == block.hash


class ShadowKV:
    """What each slot of the pool holds: the chained hash of the prefix that ends there."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[tuple[int, int], int] = {}

    @staticmethod
    def prefix_keys(seq: Sequence, upto: int) -> list[int]:
        keys, h = [], 0
        for t in seq.token_ids[:upto]:
            h = hash((h, t))
            keys.append(h)
        return keys

    def write(self, seq: Sequence, start: int, stop: int) -> None:
        bs = self.bm.block_size
        keys = self.prefix_keys(seq, stop)
        for p in range(start, stop):
            block = self.bm.blocks[seq.block_table[p // bs]]
            assert block.ref_count == 1, f"write into shared block {block.block_id}"
            assert block.hash is None, f"write into registered block {block.block_id}"
            self.slots[(block.block_id, p % bs)] = keys[p]

    def check(self, live: list[Sequence]) -> None:
        bs = self.bm.block_size
        for seq in live:
            keys = self.prefix_keys(seq, seq.num_computed_tokens)
            for p, key in enumerate(keys):
                b = seq.block_table[p // bs]
                assert self.slots.get((b, p % bs)) == key, \
                    f"{seq.request_id} reads a wrong KV at position {p} (block {b})"


# -- unit tests ------------------------------------------------------------------------------

def test_allocate_append_free_round_trip():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq, [], 10)
    bm.allocate(seq, [], 10)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    compute(bm, seq, 10)
    # Tokens 11 and 12 still fit the third block; the 13th needs a fourth.
    for expected_blocks in (3, 3, 4, 4):
        seq.token_ids.append(7)
        assert bm.num_new_blocks(seq, 1) == expected_blocks - len(seq.block_table)
        bm.append_slots(seq, 1)
        assert len(seq.block_table) == expected_blocks
        compute(bm, seq, 1)
    check_invariants(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert sorted(bm.free_blocks) == list(range(8)) and not bm.cached_free
    check_invariants(bm, [])
    bm.free(seq)  # a sequence without blocks frees nothing
    assert bm.num_free_blocks == 8


def test_allocate_twice_and_double_free_are_caught():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3])
    bm.allocate(seq, [], 3)
    with pytest.raises(AssertionError):
        bm.allocate(seq, [], 1)
    stale = list(seq.block_table)
    bm.free(seq)
    seq.block_table = stale
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(seq)


def test_without_prefix_caching_nothing_is_registered_or_hit():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.hash_to_block == {} and all(b.hash is None for b in bm.blocks)
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.match_prefix(b) == []
    bm.free(a)
    assert bm.num_cached_free_blocks == 0 and len(bm.free_blocks) == 8


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("prompt_len", [1, 3, 4, 5, 8, 16, 17, 33])
def test_second_identical_prompt_hits_all_full_blocks_but_the_last_token(block_size, prompt_len):
    bm = BlockManager(2 * -(-prompt_len // block_size) + 1, block_size, enable_prefix_caching=True)
    prompt = [(i * 5) % 3 for i in range(prompt_len)]
    first = make_seq(prompt)
    hits = bm.match_prefix(first)
    assert hits == []
    bm.allocate(first, [], prompt_len)
    # Not committed yet: nothing to share.
    assert bm.match_prefix(make_seq(prompt)) == []
    compute(bm, first, prompt_len)
    second = make_seq(prompt)
    hits = bm.match_prefix(second)
    expected = (prompt_len - 1) // block_size
    assert hits == first.block_table[:expected]
    assert len(hits) * block_size < prompt_len  # the last prompt token is always recomputed
    bm.allocate(second, hits, prompt_len - len(hits) * block_size)
    assert second.num_computed_tokens == second.num_cached_tokens == len(hits) * block_size
    for b in hits:
        assert bm.blocks[b].ref_count == 2
    compute(bm, second, prompt_len - len(hits) * block_size)
    check_invariants(bm, [first, second])
    assert bm.prefix_hits == len(hits) * block_size
    assert bm.prefix_queries == 2 * prompt_len


def test_commit_at_schedule_time_lets_a_same_step_arrival_share():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])
    bm.allocate(a, [], 5)  # first chunk: tokens 0..4, blocks 0 and 1 full once it runs
    bm.commit_full_blocks(a, 0, 5)
    assert a.num_computed_tokens == 0
    b = make_seq([1, 2, 3, 4, 5, 6, 7])
    assert bm.match_prefix(b) == a.block_table[:2]  # block 2 is not full after the chunk
    hits = bm.match_prefix(b)
    bm.allocate(b, hits, 3)
    assert b.num_computed_tokens == 4 and [bm.blocks[x].ref_count for x in hits] == [2, 2]
    a.num_computed_tokens = 5
    bm.append_slots(a, 2)
    bm.commit_full_blocks(a, 5, 7)  # the rest of the prompt: block 2 becomes full
    bm.commit_full_blocks(b, 4, 7)  # b computed the same block 2 privately
    a.num_computed_tokens = b.num_computed_tokens = 7
    assert bm.hash_to_block[bm.block_hash(a, 2)] == a.block_table[2]
    assert bm.blocks[b.block_table[2]].hash is None
    check_invariants(bm, [a, b])
    # Committing again (say, after the step) registers nothing new.
    snapshot = dict(bm.hash_to_block)
    bm.commit_full_blocks(a, 0)
    bm.commit_full_blocks(b, 0)
    assert bm.hash_to_block == snapshot


def test_hits_after_owner_freed_revive_cached_blocks():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    first = make_seq(prompt)
    prefill(bm, first)
    registered = first.block_table[:2]
    bm.free(first)
    assert list(bm.cached_free) == registered[::-1]  # the tail is released (and evicted) first
    assert bm.num_free_blocks == 6
    second = make_seq(prompt + [9])
    hits = bm.match_prefix(second)
    assert hits == registered
    assert bm.can_allocate(second, hits, 2)
    bm.allocate(second, hits, 2)
    assert not bm.cached_free
    assert [bm.blocks[b].ref_count for b in hits] == [1, 1]
    assert bm.num_free_blocks == 6 - 3
    compute(bm, second, 2)
    check_invariants(bm, [second])


def test_sequence_that_diverges_hits_only_the_common_blocks():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])
    prefill(bm, a)
    b = make_seq([1, 2, 3, 4, 9, 9, 9])
    assert bm.match_prefix(b) == a.block_table[:2]
    c = make_seq([1, 9, 3, 4, 5, 6, 7])
    assert bm.match_prefix(c) == []


def test_chain_hash_same_block_under_another_prefix_does_not_hit():
    bm = BlockManager(12, 4, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    prefill(bm, a)
    b = make_seq([0, 0, 0, 0, 5, 6, 7, 8, 0])  # block 1 has a's tokens, block 0 does not
    assert bm.block_hash(b, 1) != bm.block_hash(a, 1)
    assert bm.block_tokens(b, 1) == bm.block_tokens(a, 1)
    assert bm.match_prefix(b) == []
    prefill(bm, b)
    # b's second block is registered separately: same tokens, another prefix, another block.
    assert b.block_table[1] != a.block_table[1]
    assert bm.blocks[b.block_table[1]].hash == bm.block_hash(b, 1)
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(c) == a.block_table[:2]
    d = make_seq([0, 0, 0, 0, 5, 6, 7, 8, 1])
    assert bm.match_prefix(d) == b.block_table[:2]
    check_invariants(bm, [a, b])
    assert chain_hash(None, (5, 6, 7, 8)) != chain_hash(chain_hash(None, (0, 0, 0, 0)),
                                                        (5, 6, 7, 8))


def test_same_content_computed_twice_concurrently_keeps_second_copy_private():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 3])
    bm.allocate(a, [], 3)
    bm.allocate(b, [], 3)  # admitted in the same step: a's blocks are not computed yet
    compute(bm, a, 3)
    compute(bm, b, 3)
    h = bm.block_hash(a, 0)
    assert bm.hash_to_block[h] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None
    check_invariants(bm, [a, b])
    bm.free(b)
    assert b.block_table == [] and not bm.cached_free  # the private copy goes back to free
    bm.free(a)
    assert list(bm.cached_free) == [bm.hash_to_block[h]]
    check_invariants(bm, [])


def test_cached_free_blocks_are_evicted_lru_and_forgotten():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    a0, a1, a2 = a.block_table
    h0, h1 = bm.blocks[a0].hash, bm.blocks[a1].hash
    bm.free(a)
    assert list(bm.cached_free) == [a1, a0]  # released tail first
    assert set(bm.free_blocks) == {a2, 3}
    # Three fresh blocks: the two free ones, then the least recently released cached one.
    b = make_seq([7, 7, 7, 7, 7, 7])
    assert bm.match_prefix(b) == []
    bm.allocate(b, [], 6)
    assert a1 in b.block_table and a0 not in b.block_table
    assert h1 not in bm.hash_to_block and bm.blocks[a1].hash is None
    assert bm.blocks[a1].token_ids == ()
    assert bm.hash_to_block[h0] == a0 and list(bm.cached_free) == [a0]
    # a's first block can still be hit, its second cannot.
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == [a0]
    compute(bm, b, 6)
    check_invariants(bm, [b])
    c = make_seq([9, 9])
    bm.allocate(c, [], 1)  # the last cached block goes too
    assert c.block_table == [a0] and h0 not in bm.hash_to_block
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert bm.num_free_blocks == 0


def test_lru_order_follows_release_and_reuse():
    bm = BlockManager(6, 1, enable_prefix_caching=True)
    x, y = make_seq([1, 2]), make_seq([3, 4])
    prefill(bm, x)
    prefill(bm, y)
    (x0, x1), (y0, y1) = x.block_table, y.block_table
    bm.free(x)
    bm.free(y)
    assert list(bm.cached_free) == [x1, x0, y1, y0]
    # Reusing x's first block makes it the most recently used once released again.
    x2 = make_seq([1, 5])
    assert bm.match_prefix(x2) == [x0]
    prefill(bm, x2)
    fresh = x2.block_table[1]
    bm.free(x2)
    assert list(bm.cached_free) == [x1, y1, y0, fresh, x0]
    # One free block left, then three evictions: x1, y1, y0 (x0 survives).
    assert len(bm.free_blocks) == 1
    filler = make_seq([8] * 4)
    bm.allocate(filler, [], 4)
    assert set(filler.block_table) - set(range(6)) == set()
    assert {x1, y1, y0} < set(filler.block_table) and x0 not in filler.block_table
    assert list(bm.cached_free) == [fresh, x0]
    assert bm.match_prefix(make_seq([1, 0])) == [x0]
    assert bm.match_prefix(make_seq([3, 0])) == []
    check_invariants(bm, [filler])


def test_reset_prefix_cache_frees_cached_blocks_only():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a, b = make_seq([1, 2, 3]), make_seq([4, 5, 6])
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    assert bm.num_cached_free_blocks == 1
    bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 4
    assert bm.match_prefix(make_seq([1, 2, 3])) == []
    assert bm.match_prefix(make_seq([4, 5, 6])) == b.block_table[:1]  # in use: kept
    check_invariants(bm, [b])


def test_can_allocate_is_exact_at_the_boundary():
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)  # 3 blocks, 2 registered
    bm.free(a)  # 2 cached + 3 free
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # 2 hits + 7 tokens = 4 fresh blocks
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    # Reviving the 2 cached blocks takes them from the 5 available, 3 are left for fresh ones.
    assert bm.can_allocate(b, hits, 6)
    assert not bm.can_allocate(b, hits, 7)
    trial = copy.deepcopy((bm, b))
    with pytest.raises(KeyError):
        trial[0].allocate(trial[1], hits, 7)
    bm.allocate(b, hits, 6)
    assert bm.num_free_blocks == 0


def test_can_append_is_exact():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    seq = make_seq([1] * 5)
    bm.allocate(seq, [], 5)
    compute(bm, seq, 5)
    assert bm.num_new_blocks(seq, 3) == 0 and bm.can_append(seq, 3)
    assert bm.num_new_blocks(seq, 7) == 1 and bm.can_append(seq, 7)
    assert bm.num_new_blocks(seq, 8) == 2 and not bm.can_append(seq, 8)


# -- property tests --------------------------------------------------------------------------

bm_configs = st.tuples(
    st.integers(1, 16),  # num_blocks
    st.sampled_from([1, 2, 4, 16]),  # block_size
    st.booleans(),  # prefix caching
    st.integers(1, 3),  # alphabet size - 1
)

chunks = st.sampled_from([1, 2, 3, 5, 8, 64])
new_op = st.tuples(st.just("new"), st.sampled_from([40, 40, 8, 5, 3]) | st.integers(0, 40),
                   st.lists(st.integers(0, 3), max_size=2), chunks)
compute_op = st.tuples(st.just("compute"), st.integers(0, 50), chunks)
free_op = st.tuples(st.just("free"), st.integers(0, 50))
# A new request takes a prefix of the shared base (so prefixes repeat) plus a short tail.
_op_kinds = [new_op] * 4 + [compute_op] * 4 + [free_op] * 3 + [st.tuples(st.just("reset"))]
op = st.integers(0, len(_op_kinds) - 1).flatmap(lambda k: _op_kinds[k])


def _must_run_out(fn, *objs) -> None:
    """fn on deep copies of objs raises because the pool is empty (proves a False is exact)."""
    trial = copy.deepcopy(objs)
    with pytest.raises(KeyError):
        fn(*trial)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bm_configs, st.lists(st.integers(0, 3), min_size=1, max_size=40),
       st.lists(op, min_size=10, max_size=60))
def test_block_manager_random_operations(config, base, ops):
    num_blocks, bs, caching, alpha = config
    bm = BlockManager(num_blocks, bs, caching)
    kv = ShadowKV(bm)
    live: list[Sequence] = []
    base = [t % (alpha + 1) for t in base]
    cap = num_blocks * bs
    for o in ops:
        if o[0] == "new":
            _, keep, tail, chunk = o
            prompt = (base[:keep] + [t % (alpha + 1) for t in tail])[:cap - 1] or [0]
            seq = make_seq(prompt)
            hits = bm.match_prefix(seq)
            assert len(hits) * bs < seq.num_tokens
            if caching:
                # Every hit is a registered block holding exactly this prefix.
                for i, b in enumerate(hits):
                    assert bm.blocks[b].hash == bm.block_hash(seq, i)
            n = min(chunk, seq.num_tokens - len(hits) * bs)
            if bm.can_allocate(seq, hits, n):
                free_before = bm.num_free_blocks
                bm.allocate(seq, hits, n)
                taken = free_before - bm.num_free_blocks
                assert taken == bm.blocks_for_tokens(len(hits) * bs + n) - len(hits) + \
                    sum(1 for b in hits if bm.blocks[b].ref_count == 1)
                live.append(seq)
                before = seq.num_computed_tokens
                kv.write(seq, before, before + n)
                compute(bm, seq, n)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(len(live) % (alpha + 1))
            else:
                _must_run_out(lambda m, s, h=hits, k=n: m.allocate(s, h, k), bm, seq)
        elif o[0] == "compute" and live:
            seq = live[o[1] % len(live)]
            n = min(o[2], seq.num_uncomputed_tokens)
            if bm.can_append(seq, n):
                bm.append_slots(seq, n)
                before = seq.num_computed_tokens
                kv.write(seq, before, before + n)
                compute(bm, seq, n)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(seq.num_tokens % (alpha + 1))
            else:
                _must_run_out(lambda m, s, k=n: m.append_slots(s, k), bm, seq)
        elif o[0] == "free" and live:
            seq = live.pop(o[1] % len(live))
            bm.free(seq)
            assert seq.block_table == []
        elif o[0] == "reset":
            bm.reset_prefix_cache()
            assert not bm.cached_free
        check_invariants(bm, live)
        kv.check(live)
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks and bm.num_used_blocks == 0


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 12), st.sampled_from([1, 2, 4, 16]), st.lists(st.integers(0, 2),
                                                                    min_size=1, max_size=60),
       st.lists(st.integers(0, 2), max_size=8), st.integers(0, 60))
def test_prefix_hits_equal_committed_full_blocks(num_blocks, bs, prompt, tail, keep):
    cap = num_blocks * bs
    prompt = prompt[:cap - 1]
    bm = BlockManager(num_blocks, bs, True)
    first = make_seq(prompt)
    prefill(bm, first)
    again = make_seq(prompt)
    assert bm.match_prefix(again) == first.block_table[:(len(prompt) - 1) // bs]
    # A sequence sharing only a prefix hits exactly the full blocks inside the common part.
    other = (prompt[:keep] + tail)[:cap - 1] or [1]
    common = 0
    while common < min(len(prompt), len(other)) and prompt[common] == other[common]:
        common += 1
    hits = bm.match_prefix(make_seq(other))
    assert len(hits) == min(common // bs, (len(prompt)) // bs, (len(other) - 1) // bs)
    assert hits == first.block_table[:len(hits)]


def test_a_more_urgent_releasers_cached_blocks_are_evicted_last():
    """Cached-free blocks go least urgent releaser first, then least recently released: a
    chat's prefix (released first, at -1) outlives a later background request's (at 0),
    and is still evictable once nothing else is left (the pool's capacity is unchanged)."""
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    bm.evict_by_priority = True  # the scheduler's setting under the priority policy
    chat = Sequence("chat", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, priority=-1))
    bg = make_seq([7, 8, 9, 10, 11])
    prefill(bm, chat)
    prefill(bm, bg)
    chat_blocks, bg_blocks = chat.block_table[:2], bg.block_table[:2]
    bm.free(chat)
    bm.free(bg)
    assert list(bm.cached_free) == bg_blocks[::-1] + chat_blocks[::-1]  # eviction order
    assert bm.num_free_blocks == 6
    new = make_seq([20, 21, 22, 23, 24, 25, 26])  # 4 blocks: 2 free, then 2 evicted
    prefill(bm, new)
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == chat_blocks  # the chat's stayed
    assert bm.match_prefix(make_seq([7, 8, 9, 10, 11])) == []
    more = make_seq([30, 31, 32])  # 2 blocks: only the chat's are left to evict
    prefill(bm, more)
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == [] and not bm.cached_free
    check_invariants(bm, [new, more])
    with pytest.raises(KeyError):
        bm.append_blocks(more, 1)  # nothing free, nothing cached: as before
