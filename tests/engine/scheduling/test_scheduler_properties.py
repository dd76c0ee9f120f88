"""Scheduler + BlockManager under random interleavings of add / step / abort, without a model.

Each step does what LLMEngine.step does around the model: the scheduler registers the blocks a
chunk fills when it schedules it; the "model" writes a shadow KV pool (each slot holds a hash of
the prefix ending there); then the chunk is marked computed, a token is sampled when the chunk
reached the end, and the request finishes at max_tokens. A block shared with the wrong prefix, or
reused while still read, shows up as a wrong value read back.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduling.scheduler import ScheduledSeq, Scheduler
from kvscope.engine.sequence import Sequence, SequenceStatus
from tests.engine.kv_cache.test_block_manager import ShadowKV
from tests.engine.kv_cache.test_block_manager import check_invariants as check_pool

prefix_keys = ShadowKV.prefix_keys

MAX_DRAIN_STEPS = 10_000
_ids = itertools.count()


@dataclass
class Sim:
    """A model-free engine: scheduler, block manager, shadow KV and the bookkeeping of a step."""
    bm: BlockManager
    sched: Scheduler
    alphabet: int

    def __post_init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}
        self.seqs: list[Sequence] = []
        self.admitted_at: dict[int, int] = {}  # id(seq) -> admission counter (latest admission)
        self.admissions = 0
        self.capacity_finished: list[Sequence] = []
        self.steps = 0

    @property
    def capacity(self) -> int:
        return self.bm.num_blocks * self.bm.block_size

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        assert len(prompt) + 1 <= self.capacity
        seq = Sequence(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens))
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def abort(self, seq: Sequence) -> None:
        self.sched.finish(seq, "abort")
        assert seq.is_finished and seq.block_table == []
        assert seq not in self.sched.running and seq not in self.sched.waiting

    def step(self) -> None:
        sched = self.sched
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        preempt_before = sched.num_preemptions
        batch = sched.schedule()
        self.steps += 1

        self.check_batch(batch)
        seqs = [item.seq for item in batch]

        # -- capacity finishes: only a sequence that cannot fit even alone -----------------
        for s in sched.finished_by_capacity:
            assert s.is_finished and s.finish_reason == "length" and s.block_table == []
            assert s.num_tokens == self.capacity + 1, \
                f"{s.request_id} finished for capacity with {s.num_tokens} tokens " \
                f"(pool holds {self.capacity})"
            assert s not in seqs
        self.capacity_finished += sched.finished_by_capacity
        sched.finished_by_capacity = []

        # -- preemption: victims are the most recently admitted running requests -----------
        preempted = [s for s in running_before if s.status == SequenceStatus.WAITING]
        if preempted:
            assert sched.num_preemptions - preempt_before == len(preempted)
            kept = [s for s in running_before if s.status != SequenceStatus.WAITING]
            assert running_before[len(kept):] == preempted, \
                "a preempted request is not among the most recently admitted"
            assert list(sched.waiting)[:len(preempted)] == preempted, \
                "preempted requests must go back to the head of the queue in arrival order"
            admitted_now = [s for s in waiting_before if s in sched.running]
            assert not admitted_now, "admitted new work in a step that preempted"
        else:
            assert sched.num_preemptions == preempt_before
        for s in sched.running:
            if s not in running_before:
                self.admissions += 1
                self.admitted_at[id(s)] = self.admissions
        order = [self.admitted_at[id(s)] for s in sched.running]
        assert order == sorted(order), "running is not in admission order"

        # -- the step: the model writes every chunk's K/V, then the engine's bookkeeping ----
        self.run_model(batch, [s for s in waiting_before if s in sched.running])

    def check_batch(self, batch: list[ScheduledSeq]) -> None:
        """What any schedule must hold: each running sequence once, within the budgets, with
        blocks for what it computes."""
        sched, bm = self.sched, self.bm
        seqs = [item.seq for item in batch]
        assert len(seqs) == len({id(s) for s in seqs}), "a sequence is scheduled twice"
        assert sum(item.num_tokens for item in batch) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for item in batch:
            s = item.seq
            assert s.status == SequenceStatus.RUNNING and s in sched.running
            assert 1 <= item.num_tokens <= s.num_uncomputed_tokens
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + item.num_tokens

    def run_model(self, batch: list[ScheduledSeq], admitted: list[Sequence] | None = None
                  ) -> None:
        """Write each chunk's K/V into the shadow pool, mark it computed, sample, finish.

        Blocks are registered when scheduled, so a request admitted in this step (`admitted`;
        None: any) may hit a block whose K/V is written in this same step; no one else may
        share a written block."""
        bm, sched = self.bm, self.sched
        new = None if admitted is None else {id(s) for s in admitted}
        for item in batch:
            s = item.seq
            keys = prefix_keys(s, s.num_computed_tokens + item.num_tokens)
            for p in range(s.num_computed_tokens, s.num_computed_tokens + item.num_tokens):
                block_id = s.block_table[p // bm.block_size]
                for other in sched.running:
                    if other is s or block_id not in other.block_table:
                        continue
                    hits = other.block_table[:other.num_cached_tokens // bm.block_size]
                    assert (new is None or id(other) in new) and block_id in hits, \
                        f"{s.request_id} writes block {block_id} that {other.request_id} holds"
                self.slots[(block_id, p % bm.block_size)] = keys[p]
        for item in batch:
            item.seq.num_computed_tokens += item.num_tokens
        for item in batch:  # everything a scheduled request attends to is its own prefix
            self.check_reads(item.seq)
        for item in batch:
            s = item.seq
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append((s.num_tokens * 7 + len(s.request_id)) % self.alphabet)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
                    self.finished(s)

    def finished(self, s: Sequence) -> None:
        """A request the model just finished (a subclass may note when)."""

    def check_reads(self, s: Sequence) -> None:
        bs = self.bm.block_size
        for p, key in enumerate(prefix_keys(s, s.num_computed_tokens)):
            b = s.block_table[p // bs]
            assert self.slots.get((b, p % bs)) == key, \
                f"{s.request_id} reads a wrong KV at position {p} (block {b})"

    def check(self) -> None:
        sched, bm = self.sched, self.bm
        live = self.live()
        assert {id(s) for s in live} == {id(s) for s in list(sched.running) + list(sched.waiting)}
        assert len(sched.running) + len(sched.waiting) == len(live)
        for s in sched.running:
            assert s.status == SequenceStatus.RUNNING
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
            assert s.num_computed_tokens < s.num_tokens  # a token is always left to compute
        for s in sched.waiting:
            assert s.status == SequenceStatus.WAITING
            assert s.block_table == [] and s.num_computed_tokens == 0
        assert len(sched.running) <= sched.max_num_seqs
        check_pool(bm, list(sched.running))
        for s in sched.running:  # everything computed reads back its own prefix
            self.check_reads(s)

    def drain_limit(self, limit: int) -> int:
        """The most steps draining may take (see drain)."""
        return min(limit, sum(s.num_prompt_tokens + s.params.max_tokens + 2
                              for s in self.live()))

    def drain(self, limit: int = MAX_DRAIN_STEPS) -> int:
        """Step until nothing is left; a livelock fails.

        Besides the fixed limit, the steps are bounded by the work left: the oldest running
        request is never preempted and computes at least one token every step, so it is done
        within prompt + max_tokens steps of becoming the oldest; a step without a running
        request admits one (or finishes one for capacity), and a step whose oldest request is
        finished for capacity preempted the rest and admits nothing (+1).
        """
        limit = self.drain_limit(limit)
        steps = 0
        while self.sched.has_unfinished():
            assert steps < limit, f"livelock: still unfinished after {limit} steps"
            self.step()
            self.check()
            steps += 1
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        check_pool(self.bm, [])
        return steps

    def check_completed(self) -> None:
        """Without aborts: every request got max_tokens, or truly outgrew the pool."""
        capacity_ids = {id(s) for s in self.capacity_finished}
        for s in self.seqs:
            assert s.is_finished and s.finish_reason == "length"
            if id(s) in capacity_ids:
                assert s.num_tokens == self.capacity + 1
                assert s.num_output_tokens < s.params.max_tokens
            else:
                assert s.num_output_tokens == s.params.max_tokens, \
                    f"{s.request_id}: {s.num_output_tokens} of {s.params.max_tokens} tokens"


def make_sim(num_blocks: int, bs: int, caching: bool, max_seqs: int, budget: int,
             alphabet: int) -> Sim:
    bm = BlockManager(num_blocks, bs, caching)
    return Sim(bm, Scheduler(bm, max_seqs, budget), alphabet)


configs = st.tuples(
    st.integers(4, 24),  # num_blocks
    st.sampled_from([1, 2, 4, 16]),  # block_size
    st.booleans(),  # prefix caching
    st.integers(1, 6),  # max_num_seqs
    st.sampled_from([1, 2, 3, 5, 8, 16, 64, 512]),  # max_num_batched_tokens
    st.integers(1, 3),  # alphabet size
)


@st.composite
def prompts(draw, base: list[int], alphabet: int, capacity: int) -> list[int]:
    """A prefix of the shared base plus a short random tail: prefixes repeat on purpose."""
    keep = draw(st.integers(0, len(base)))
    tail = draw(st.lists(st.integers(0, alphabet - 1), max_size=6))
    prompt = (base[:keep] + tail)[:min(capacity - 1, 48)]
    return prompt or [0]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=configs, base=st.lists(st.integers(0, 2), min_size=1, max_size=40))
    def setup(self, config, base):
        num_blocks, bs, caching, max_seqs, budget, alphabet = config
        self.sim = make_sim(num_blocks, bs, caching, max_seqs, budget, alphabet)
        self.base = [t % alphabet for t in base]
        self.aborted = False

    @rule(data=st.data(), max_tokens=st.integers(1, 20))
    def add(self, data, max_tokens):
        sim = self.sim
        prompt = data.draw(prompts(self.base, sim.alphabet, sim.capacity))
        sim.add(prompt, max_tokens)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self.sim.step()
            self.sim.check()

    @precondition(lambda self: hasattr(self, "sim") and self.sim.live())
    @rule(data=st.data())
    def abort(self, data):
        live = self.sim.live()
        self.sim.abort(data.draw(st.sampled_from(live)))
        self.aborted = True

    @rule()
    def reset_prefix_cache(self):
        self.sim.bm.reset_prefix_cache()
        assert self.sim.bm.num_cached_free_blocks == 0

    @invariant()
    def consistent(self):
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.drain()
            if not self.aborted:
                self.sim.check_completed()


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestSchedulerMachine = SchedulerMachine.TestCase


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.data())
def test_liveness_without_aborts(config, data):
    """Requests arriving over time all finish within a bounded number of steps, nothing leaks."""
    num_blocks, bs, caching, max_seqs, budget, alphabet = config
    sim = make_sim(num_blocks, bs, caching, max_seqs, budget, alphabet)
    base = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=40))
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 20)),
                                  min_size=1, max_size=10))
    for gap, max_tokens in arrivals:
        sim.add(data.draw(prompts(base, alphabet, sim.capacity)), max_tokens)
        for _ in range(gap):
            sim.step()
            sim.check()
    sim.drain()
    sim.check_completed()
    # The global preemption counter agrees with the per-request ones.
    assert sum(s.num_preemptions for s in sim.seqs) == sim.sched.num_preemptions


# -- deterministic preemption tests ---------------------------------------------------------

def test_preemption_victim_is_most_recent_and_everyone_finishes():
    # 4 blocks of 2 tokens; each request needs 3 blocks by its last token, so three do not fit.
    sim = make_sim(4, 2, caching=False, max_seqs=4, budget=64, alphabet=3)
    a = sim.add([0, 1], max_tokens=5)
    b = sim.add([1, 2], max_tokens=5)
    c = sim.add([2, 0], max_tokens=5)
    sim.step()  # all three admitted, one block each, one token sampled each
    sim.check()
    assert sim.sched.running == [a, b, c] and sim.bm.num_free_blocks == 1
    sim.step()  # a takes the last free block, b needs one: c (admitted last) is preempted
    sim.check()
    assert sim.sched.num_preemptions == 1
    assert c.status == SequenceStatus.WAITING and c.num_preemptions == 1
    assert list(sim.sched.waiting) == [c] and c.block_table == [] and c.num_computed_tokens == 0
    assert sim.sched.running == [a, b] and a.num_preemptions == b.num_preemptions == 0
    assert c.num_output_tokens == 1  # its sampled token is kept and recomputed
    sim.drain(limit=200)
    sim.check_completed()
    assert sim.sched.num_preemptions > 0 and not sim.capacity_finished
    for s in (a, b, c):
        assert s.num_output_tokens == 5 and s.finish_reason == "length"


def test_preemption_with_prefix_caching_and_long_requests():
    sim = make_sim(6, 2, caching=True, max_seqs=6, budget=8, alphabet=2)
    seqs = [sim.add([0, 1, 0, 1, i % 2], max_tokens=6) for i in range(5)]
    sim.drain(limit=500)
    sim.check_completed()
    assert sim.sched.num_preemptions > 0
    assert any(s.num_preemptions > 0 for s in seqs)
    for s in seqs:
        assert s.num_output_tokens == 6 and s.finish_reason == "length"
    assert sim.bm.prefix_hits > 0


def test_request_that_outgrows_the_pool_is_finished_for_capacity():
    sim = make_sim(2, 2, caching=False, max_seqs=2, budget=64, alphabet=2)
    seq = sim.add([1, 0, 1], max_tokens=10)
    sim.drain(limit=50)
    assert sim.capacity_finished == [seq]
    assert seq.finish_reason == "length" and seq.num_tokens == 5 and seq.num_output_tokens == 2


def test_preempted_request_that_outgrows_the_pool_waits_then_finishes_for_capacity():
    # b gets too long while a still runs: b preempts itself, then is dropped once alone.
    sim = make_sim(3, 2, caching=False, max_seqs=2, budget=64, alphabet=2)
    a = sim.add([0, 1], max_tokens=3)
    b = sim.add([1, 1, 0], max_tokens=20)
    sim.drain(limit=100)
    assert a.num_output_tokens == 3
    assert sim.capacity_finished == [b] and b.num_tokens == 7
