"""Priority scheduling, aging, the prefill cap while decoding, and the preemption counters.

Most tests drive the Scheduler and a real BlockManager without a model, through the shadow-KV
simulation of test_scheduler_properties (Sim): a block shared with the wrong prefix or reused
while still read shows up as a wrong value read back. Times come from a fake clock.
"""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvscope.engine.block_manager import BlockManager
from kvscope.engine.config import EngineConfig
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduler import ScheduledSeq, Scheduler, scheduler_for
from kvscope.engine.sequence import Sequence, SequenceStatus
from tests.engine.test_scheduler_properties import Sim, prefix_keys

_ids = itertools.count()
WAIT_REASONS = {"budget", "max_num_seqs", "memory", "preempted"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def at_decode(s: Sequence) -> bool:
    return s.num_tokens - s.num_computed_tokens == 1 and s.num_output_tokens > 0


class PSim(Sim):
    """Sim with priorities, arrival times from a fake clock (1 s per step) and checks of the
    priority rules in every step."""

    def __init__(self, bm: BlockManager, sched: Scheduler, alphabet: int, clock: Clock) -> None:
        super().__init__(bm, sched, alphabet)
        self.clock = clock
        self.thrown: dict[int, int] = {}  # id(seq) -> tokens it had computed when preempted
        self.recomputed = 0
        # per step: (index in seqs, tokens) scheduled, then (index, -1) for each preemption
        self.history: list[list[tuple[int, int]]] = []
        self.left_at: dict[int, float] = {}  # id(seq) -> when it finished (the fake clock)

    def add(self, prompt: list[int], max_tokens: int, priority: int = 0, age: float = 0.0
            ) -> Sequence:
        """age: it arrived that long ago (a server may queue it a little after arrival)."""
        assert len(prompt) + 1 <= self.capacity
        seq = Sequence(f"p{next(_ids)}", prompt,
                       SamplingParams(max_tokens=max_tokens, priority=priority),
                       arrival_time=self.clock.now - age)
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def key(self, s: Sequence) -> tuple[float, float]:
        """The order the priority policy promises (ties: arrival order, checked as <=)."""
        aging = self.sched.priority_aging_s
        p, t = s.params.priority, s.arrival_time
        return (p * aging + t, t) if aging > 0 else (p, t)

    def step(self) -> None:
        sched, bm = self.sched, self.bm
        priority = sched.policy == "priority"
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        computed_before = {id(s): s.num_computed_tokens for s in running_before}
        now = self.clock.now
        live = [s.params.priority for s in (*running_before, *waiting_before)]
        batch = sched.schedule()
        urgent = sched._urgent  # the priority this step protected; None: not protected
        self.check_protection(batch, running_before, live, urgent)
        self.steps += 1
        self.clock.now += 1.0
        index = {s.request_id: i for i, s in enumerate(self.seqs)}
        self.history.append([(index[i.seq.request_id], i.num_tokens) for i in batch]
                            + [(index[p.request_id], -1) for p in sched.last_preemptions])

        seqs = [item.seq for item in batch]
        assert len(seqs) == len({id(s) for s in seqs}), "a sequence is scheduled twice"
        assert sum(item.num_tokens for item in batch) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for item in batch:
            s = item.seq
            assert s.status == SequenceStatus.RUNNING and s in sched.running
            assert 1 <= item.num_tokens <= s.num_uncomputed_tokens
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + item.num_tokens
            assert s.wait_reason == "" and s.first_scheduled_time is not None
        cap = sched.max_prefill_tokens_while_decoding
        # the cap counts the decodes of the protected priority only (all of them unprotected)
        if cap and any(at_decode(s) and (urgent is None or s.params.priority <= urgent)
                       for s in running_before):
            prefill = sum(i.num_tokens for i in batch if not at_decode(i.seq))
            assert prefill <= max(cap, bm.block_size), f"{prefill} prefill tokens while decoding"

        for s in sched.finished_by_capacity:
            assert s.is_finished and s.finish_reason == "length" and s.block_table == []
            self.left_at[id(s)] = now
        self.capacity_finished += sched.finished_by_capacity
        sched.finished_by_capacity = []

        # -- preemptions ---------------------------------------------------------------------
        pre = sched.last_preemptions
        preempted = [s for s in running_before if s.status == SequenceStatus.WAITING]
        assert sorted(p.request_id for p in pre) == sorted(s.request_id for s in preempted)
        admitted = [s for s in waiting_before if s in sched.running]
        by_id = {s.request_id: s for s in running_before}
        for p in pre:
            victim = by_id[p.request_id]
            assert p.priority == victim.params.priority and victim.wait_reason == "preempted"
            self.thrown[id(victim)] = computed_before[id(victim)]
            if p.reason == "priority":
                assert priority, "fcfs never preempts for priority"
                # strictly more urgent and ahead in the (aged) order: equal ones never
                assert any(a.params.priority < victim.params.priority
                           and self.key(a) <= self.key(victim) for a in admitted)
            else:
                assert p.reason == "memory"
                if priority:  # the victim is the last of the order: nothing kept is behind it
                    assert all(self.key(s) <= self.key(victim) for s in sched.running)
        if priority:
            still = [s for s in waiting_before if s.status == SequenceStatus.WAITING]
            for a in admitted:  # admitted in queue order: no one left behind sorts before
                assert all(self.key(a) <= self.key(w) for w in still)
        for item in batch:  # recomputed: what had been computed minus the prefix-cache hits
            s = item.seq
            if id(s) in self.thrown and s in admitted:
                self.recomputed += max(0, self.thrown.pop(id(s)) - s.num_computed_tokens)
        assert sched.recomputed_tokens == self.recomputed

        self.run_model(batch, admitted)

    def abort(self, seq: Sequence) -> None:
        super().abort(seq)
        self.left_at[id(seq)] = self.clock.now

    def check_protection(self, batch: list[ScheduledSeq], running_before: list[Sequence],
                         live: list[int], urgent: int | None) -> None:
        """Protected steps: on while priorities differ among the live requests (or in the
        hold after more urgent ones left), and then the less urgent work in the step is at
        most priority_lower_tokens tokens, handed round-robin (served within len(them))."""
        sched = self.sched
        on = sched.policy == "priority" and sched.priority_lower_tokens > 0
        if on and live and min(live) < max(live):
            assert urgent is not None and urgent <= min(live)
        if not on:
            assert urgent is None
        if urgent is None:
            return
        if not live or min(live) >= max(live):  # only a hold: a more urgent one left lately
            assert any(s.is_finished and s.params.priority == urgent
                       and self.clock.now - self.left_at.get(id(s), -math.inf)
                       < sched.priority_hold_s for s in self.seqs), "protected without a cause"
        lower = [i for i in batch if i.seq.params.priority > urgent]
        assert sum(i.num_tokens for i in lower) <= sched.priority_lower_tokens

    def run_model(self, batch: list[ScheduledSeq], admitted: list[Sequence] | None = None
                  ) -> None:
        """Write each chunk's K/V into the shadow pool, mark it computed, sample, finish.

        A block a chunk fills may be shared only by a request admitted in this same step
        that took it as a prefix hit (blocks are registered when scheduled)."""
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
        for item in batch:
            self.check_reads(item.seq)
        for item in batch:
            s = item.seq
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append((s.num_tokens * 7 + len(s.request_id)) % self.alphabet)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
                    self.left_at[id(s)] = self.clock.now

    def check(self) -> None:
        super().check()
        sched = self.sched
        for s in sched.waiting:
            assert s.wait_reason in WAIT_REASONS, s.wait_reason
        for s in sched.running:
            assert s.wait_reason == "" and s.first_scheduled_time is not None
        if sched.policy == "priority":
            for order in (list(sched.running), list(sched.waiting)):
                keys = [self.key(s) for s in order]
                assert keys == sorted(keys), "not in (priority, arrival) order"
        counts: dict[int, int] = {}
        for s in sched.waiting:
            counts[s.params.priority] = counts.get(s.params.priority, 0) + 1
        assert sched.waiting_by_priority() == counts

    def rebuild(self, num_blocks: int, block_size: int, caching: bool, config: EngineConfig
                ) -> None:
        """What LLMEngine.reconfigure does on a pool change: a new pool and scheduler, every
        live request reset for recompute and queued again, running ones first."""
        live = list(self.sched.running) + list(self.sched.waiting)
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = scheduler_for(self.bm, config, self.sched)
        for s in live:
            s.reset_for_recompute()
            self.sched.add(s)
        self.slots.clear()
        self.thrown.clear()

    def drain(self, limit: int = 20_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            assert steps < limit, f"livelock: still unfinished after {limit} steps"
            self.step()
            self.check()
            steps += 1
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        return steps

    def check_completed(self) -> None:
        """Without aborts: every request got max_tokens, or outgrew the pool."""
        capacity_ids = {id(s) for s in self.capacity_finished}
        for s in self.seqs:
            assert s.is_finished and s.finish_reason == "length"
            if id(s) not in capacity_ids:
                assert s.num_output_tokens == s.params.max_tokens


def psim(num_blocks: int = 16, bs: int = 2, caching: bool = False, max_seqs: int = 4,
         budget: int = 64, alphabet: int = 3, policy: str = "priority", aging: float = 0.0,
         cap: int = 0, lower: int = 0, hold: float = 0.0) -> PSim:
    bm = BlockManager(num_blocks, bs, caching)
    clock = Clock()
    sched = Scheduler(bm, max_seqs, budget, policy=policy, priority_aging_s=aging,
                      max_prefill_tokens_while_decoding=cap, priority_lower_tokens=lower,
                      priority_hold_s=hold, clock=clock)
    return PSim(bm, sched, alphabet, clock)


def steps(sim: PSim, n: int) -> None:
    for _ in range(n):
        sim.step()
        sim.check()


def finish_order(sim: PSim) -> list[str]:
    order: list[str] = []
    while sim.sched.has_unfinished():
        live = {id(s) for s in sim.live()}
        steps(sim, 1)
        order += [s.request_id for s in sim.seqs if id(s) in live and s.is_finished]
    return order


# -- admission order ------------------------------------------------------------------------

def test_higher_priority_waiting_request_is_admitted_first():
    sim = psim(max_seqs=1)
    low = sim.add([0, 1, 2], max_tokens=2, priority=1)
    mid = sim.add([1, 1, 2], max_tokens=2, priority=0)
    high = sim.add([2, 1, 2], max_tokens=2, priority=-1)
    assert list(sim.sched.waiting) == [high, mid, low]
    assert finish_order(sim) == [high.request_id, mid.request_id, low.request_id]


def test_fcfs_ignores_priority():
    sim = psim(max_seqs=1, policy="fcfs")
    low = sim.add([0, 1, 2], max_tokens=2, priority=1)
    high = sim.add([2, 1, 2], max_tokens=2, priority=-1)
    assert finish_order(sim) == [low.request_id, high.request_id]
    assert sim.sched.preemptions_by_reason == {"memory": 0, "priority": 0}


def test_urgent_prefill_goes_before_a_running_lower_priority_prefill():
    # A long low-priority prompt is mid-prefill when an urgent one arrives: the urgent one's
    # chunk comes first in the next step instead of after the running prefill's.
    sim = psim(num_blocks=64, max_seqs=4, budget=8)
    low = sim.add(list(range(3)) * 10, max_tokens=2, priority=0)
    steps(sim, 1)
    high = sim.add([1, 2, 1, 2, 1, 2], max_tokens=2, priority=-1)
    batch = sim.sched.schedule()
    assert [(i.seq, i.num_tokens) for i in batch] == [(high, 6), (low, 2)]
    assert sim.sched.running == [high, low]
    sim.run_model(batch)
    sim.drain()
    sim.check_completed()


# -- preemption for priority ----------------------------------------------------------------

def saturated(priority: int, policy: str = "priority") -> tuple[PSim, list[Sequence], Sequence]:
    sim = psim(num_blocks=32, max_seqs=2, policy=policy)
    a = sim.add([0, 1], max_tokens=8)
    b = sim.add([1, 0], max_tokens=8)
    steps(sim, 2)
    w = sim.add([2, 2, 1], max_tokens=3, priority=priority)
    return sim, [a, b], w


def test_urgent_request_preempts_the_latest_lower_priority_one_at_max_num_seqs():
    sim, (a, b), w = saturated(priority=-1)
    before = b.num_computed_tokens
    steps(sim, 1)
    assert sim.sched.running == [w, a] and list(sim.sched.waiting) == [b]
    [p] = sim.sched.last_preemptions
    assert (p.request_id, p.reason, p.priority) == (b.request_id, "priority", 0)
    assert len(p.block_ids) == 2 and b.wait_reason == "preempted"
    assert sim.sched.preemptions_by_reason == {"memory": 0, "priority": 1}
    assert sim.sched.num_preemptions == 1 == b.num_preemptions
    steps(sim, 1)
    assert sim.sched.last_preemptions == []  # cleared by each schedule()
    sim.drain()
    sim.check_completed()
    # no prefix caching: everything b had computed was computed again
    assert sim.sched.recomputed_tokens == before


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_equal_priority_never_preempts(policy):
    sim, (a, b), w = saturated(priority=0, policy=policy)
    steps(sim, 1)
    assert sim.sched.running == [a, b] and list(sim.sched.waiting) == [w]
    assert w.wait_reason == "max_num_seqs" and w.first_scheduled_time is None
    assert finish_order(sim)[-1] == w.request_id
    assert sim.sched.num_preemptions == 0


@pytest.mark.parametrize("aging", [0.0, 2.0])
def test_equal_priority_never_preempts_even_an_older_waiting_request(aging):
    # w arrived before the running ones (its arrival time is older) but reached the
    # scheduler after them: it sorts first, yet it must not displace an equal priority.
    sim = psim(num_blocks=32, max_seqs=2, aging=aging)
    a = sim.add([0, 1], max_tokens=6)
    b = sim.add([1, 0], max_tokens=6)
    steps(sim, 2)
    w = Sequence("older", [2, 2, 1], SamplingParams(max_tokens=3), arrival_time=-1.0)
    sim.seqs.append(w)
    sim.sched.add(w)
    assert list(sim.sched.waiting) == [w]
    steps(sim, 1)
    assert sim.sched.running == [a, b] and sim.sched.num_preemptions == 0
    assert w.wait_reason == "max_num_seqs"
    # more urgent (by enough to beat 2 s of aging) and it does displace the later one
    u = Sequence("urgent", [2, 1], SamplingParams(max_tokens=3, priority=-3),
                 arrival_time=sim.clock.now)
    sim.seqs.append(u)
    sim.sched.add(u)
    steps(sim, 1)
    assert [p.request_id for p in sim.sched.last_preemptions] == [b.request_id]
    sim.drain()
    sim.check_completed()


def test_fcfs_never_preempts_for_priority():
    sim, (a, b), w = saturated(priority=-5, policy="fcfs")
    assert finish_order(sim) == [a.request_id, b.request_id, w.request_id]
    assert sim.sched.num_preemptions == 0


def test_urgent_request_preempts_only_when_that_makes_room():
    # 6 blocks of 2: a (priority 0) and b (priority 1) hold 2 each, 2 are free.
    sim = psim(num_blocks=6, bs=2, max_seqs=4, budget=64)
    a = sim.add([0, 1, 2], max_tokens=9)
    b = sim.add([1, 1, 2], max_tokens=9, priority=1)
    steps(sim, 1)
    assert sim.bm.num_free_blocks == 2
    w = sim.add([2] * 9, max_tokens=1, priority=0)  # 5 blocks: it lacks 3
    steps(sim, 1)  # only b is of lower priority, and b's 2 blocks are not enough: no one goes
    assert sim.sched.num_preemptions == 0 and w.wait_reason == "memory"
    assert a.status == b.status == SequenceStatus.RUNNING
    u = sim.add([1] * 9, max_tokens=3, priority=-1)  # b and a together make room for u
    steps(sim, 1)
    assert [(p.request_id, p.reason) for p in sim.sched.last_preemptions] == \
        [(b.request_id, "priority"), (a.request_id, "priority")]  # the latest in order first
    assert sim.sched.running == [u] and sim.sched.preemptions_by_reason["priority"] == 2
    sim.drain()
    sim.check_completed()


def test_memory_victim_is_the_lowest_priority_latest_arrival():
    # 5 blocks of 2; three requests of one block each grow into a second: the pool runs dry.
    for policy, victim in (("priority", 1), ("fcfs", 2)):
        sim = psim(num_blocks=5, bs=2, max_seqs=4, budget=64, policy=policy)
        seqs = [sim.add([0, 1], max_tokens=6, priority=p) for p in (0, 1, 0)]
        steps(sim, 1)
        assert sim.bm.num_free_blocks == 2
        steps(sim, 1)  # three need a block, two are free
        [p] = sim.sched.last_preemptions
        assert (p.request_id, p.reason) == (seqs[victim].request_id, "memory")
        assert sim.sched.preemptions_by_reason == {"memory": 1, "priority": 0}
        sim.drain()
        sim.check_completed()


def test_preempted_request_resumes_from_the_prefix_cache():
    sim = psim(num_blocks=6, bs=2, caching=True, max_seqs=4, budget=64)
    a = sim.add([0, 1, 2, 0, 1], max_tokens=6, priority=1)
    steps(sim, 2)  # 6 tokens computed: 3 full blocks, registered in the prefix cache
    assert a.num_computed_tokens == 6
    u = sim.add([2, 2, 2, 2, 2, 2, 2, 2, 2], max_tokens=1, priority=0)  # 5 blocks: a must go
    steps(sim, 1)
    assert [p.request_id for p in sim.sched.last_preemptions] == [a.request_id]
    assert u.status == SequenceStatus.FINISHED or u in sim.sched.running
    sim.drain()
    sim.check_completed()
    assert sim.bm.prefix_hits > 0
    # a had computed 6 tokens; u's 5 blocks evicted two of a's 3 cached ones, the first
    # came back as a hit: 4 computed again
    assert sim.sched.recomputed_tokens == 4


# -- aging ----------------------------------------------------------------------------------

def flood(aging: float, steps_: int) -> tuple[PSim, Sequence]:
    """One priority-0 request under a never-ending stream of priority -1 ones."""
    sim = psim(num_blocks=64, max_seqs=1, budget=64, aging=aging)
    low = sim.add([0, 1, 2], max_tokens=1, priority=0)
    for _ in range(steps_):
        sim.add([1, 2, 0], max_tokens=1, priority=-1)
        sim.add([2, 0, 1], max_tokens=1, priority=-1)
        steps(sim, 1)
        if low.is_finished:
            break
    return sim, low


def test_without_aging_a_flood_of_urgent_work_starves_the_rest():
    _, low = flood(aging=0.0, steps_=60)
    assert not low.is_finished and low.first_scheduled_time is None
    assert low.wait_reason == "max_num_seqs"


def test_with_aging_no_request_waits_forever():
    sim, low = flood(aging=5.0, steps_=60)
    assert low.is_finished
    # it waited until the urgent arrivals were 5 s younger than it, plus the queue ahead
    assert low.first_scheduled_time is not None and 5.0 <= low.first_scheduled_time <= 12.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(0.5, 8.0), st.lists(st.integers(-3, 3), min_size=1, max_size=12), st.data())
def test_aging_bounds_every_wait(aging, priorities, data):
    """Under an endless stream of the most urgent priority, a request of priority p is
    scheduled within about (p - p_min) * aging seconds plus the queue ahead of it."""
    sim = psim(num_blocks=64, max_seqs=2, budget=64, aging=aging)
    seqs = [sim.add([i % 3, 1], max_tokens=1, priority=p) for i, p in enumerate(priorities)]
    top = -4
    limit = math.ceil((3 - top) * aging) + len(priorities) + 10
    for _ in range(limit):
        sim.add([2, 2], max_tokens=1, priority=top)
        steps(sim, 1)
    assert all(s.first_scheduled_time is not None for s in seqs)


# -- protected steps (priority_lower_tokens, priority_hold_s) ---------------------------------

def decoding_sim(num_bg: int, lower: int, hold: float = 0.0, cap: int = 0,
                 max_tokens: int = 200) -> tuple[PSim, list[Sequence]]:
    """num_bg priority-0 requests, all decoding (so no step has prefill work yet)."""
    sim = psim(num_blocks=256, bs=4, max_seqs=16, budget=64, lower=lower, hold=hold, cap=cap)
    bg = [sim.add([i % 3, 1], max_tokens=max_tokens) for i in range(num_bg)]
    steps(sim, 1)
    assert all(at_decode(s) for s in bg)
    return sim, bg


def composition(sim: PSim) -> dict[str, int]:
    """One step: request id -> tokens scheduled."""
    batch = sim.sched.schedule()
    sim.clock.now += 1
    sim.run_model(batch)
    return {i.seq.request_id: i.num_tokens for i in batch}


def test_protected_steps_serve_the_urgent_decode_and_rotate_the_rest():
    sim, bg = decoding_sim(6, lower=2)
    assert len(composition(sim)) == 6  # one priority: every decode, every step
    fg = sim.add([0, 1, 2], max_tokens=30, priority=-1)
    first = composition(sim)
    assert first[fg.request_id] == 3 and sum(first.values()) == 5  # its prefill + 2 others
    served: list[str] = []
    for _ in range(9):
        step = composition(sim)
        assert step.pop(fg.request_id) == 1  # the urgent decode, every step
        assert len(step) == 2 and set(step.values()) == {1}
        served += step
    # round-robin: over 3 steps each background request had exactly one token
    for k in range(0, 9, 3):
        window = served[2 * k:2 * k + 6]
        assert sorted(window) == sorted(s.request_id for s in bg)


def test_round_robin_is_even_when_the_allowance_does_not_divide_the_background():
    """3 background decodes, 2 tokens a step: every 3 steps each gets exactly 2 (ties of the
    last turn once went to the first in the running order, which got a token every step)."""
    sim, bg = decoding_sim(3, lower=2)
    fg = sim.add([0, 1, 2], max_tokens=30, priority=-1)
    composition(sim)
    counts = {s.request_id: 0 for s in bg}
    for step_no in range(1, 13):
        step = composition(sim)
        assert step.pop(fg.request_id) == 1
        for rid in step:
            counts[rid] += 1
        if step_no % 3 == 0:
            assert set(counts.values()) == {2 * step_no // 3}, counts


def test_urgent_prefill_is_not_capped_by_the_background_decodes():
    sim, _ = decoding_sim(4, lower=1, cap=4)
    fg = sim.add([0, 1, 2] * 6, max_tokens=2, priority=-1)  # 18 prompt tokens
    step = composition(sim)
    assert step.pop(fg.request_id) == 18 and sum(step.values()) == 1
    # ... while an urgent decode runs, the cap is back for the next urgent prompt
    fg2 = sim.add([2, 1, 0] * 6, max_tokens=2, priority=-1)
    step = composition(sim)
    assert step[fg.request_id] == 1 and step[fg2.request_id] == 4


def test_background_admissions_share_the_allowance():
    sim, _ = decoding_sim(2, lower=3)
    fg = sim.add([0, 1], max_tokens=40, priority=-1)
    steps(sim, 1)
    late = sim.add([1, 2, 0] * 4, max_tokens=2)  # a 12-token background prompt
    step = composition(sim)
    assert step.pop(fg.request_id) == 1
    assert step == {late.request_id: 3}  # its turn first: the whole allowance
    seen: set[str] = set()
    while late.num_computed_tokens < 12:  # then it shares the turns with the decodes
        step = composition(sim)
        assert step.pop(fg.request_id) == 1 and sum(step.values()) <= 3
        seen |= set(step)
    assert seen == {late.request_id, *(s.request_id for s in sim.sched.running
                                       if s.params.priority == 0 and s is not late)}


def test_an_admission_before_a_running_turn_does_not_spend_that_turn():
    """Found by the state machine: a less urgent request admitted before a running one whose
    turn it was took that turn's token, and the running one then decoded anyway (two less
    urgent tokens against an allowance of one, and the next admission got -1 tokens)."""
    sim = psim(num_blocks=9, bs=1, max_seqs=4, budget=5)
    bg = sim.add([0], max_tokens=2, priority=2)
    steps(sim, 1)  # bg decodes from here
    urgent = sim.add([0], max_tokens=1, priority=0)
    middle = sim.add([0], max_tokens=1, priority=1)  # sorts before bg: admitted before it
    sim.add([0], max_tokens=1, priority=2)
    sim.sched.configure("priority", 0.0, 0, 1, 0.0)
    step = composition(sim)
    assert step == {urgent.request_id: 1, bg.request_id: 1}  # bg's turn, not middle's
    step = composition(sim)
    assert middle.request_id in step and sum(step.values()) <= 2
    sim.drain()


@pytest.mark.parametrize("aged", [False, True])
def test_background_admission_gets_turns_beside_background_decodes(aged):
    """A less urgent waiting request takes part in the round-robin, so the running ones'
    decodes cannot spend every allowance; aged, it sorts before a new urgent request, which
    therefore waits for it: a few steps, not until the background finishes."""
    sim, bg = decoding_sim(6, lower=2)
    sim.sched.configure("priority", 2.0, 0, 2, 0.0)
    fg = sim.add([0, 1], max_tokens=200, priority=-1)
    steps(sim, 2)
    late = sim.add([1, 2, 0, 1], max_tokens=2, age=10.0 if aged else 0.0)
    urgent = sim.add([2, 2], max_tokens=2, priority=-1) if aged else fg
    assert sim.sched.waiting.head() is late
    for _ in range(len(bg) + 2):
        steps(sim, 1)
    assert late.first_scheduled_time is not None and urgent.first_scheduled_time is not None
    assert all(not s.is_finished for s in bg)  # long before the background finished


def test_hold_keeps_steps_short_after_the_urgent_request_left():
    sim, bg = decoding_sim(6, lower=2, hold=4.0)
    fg = sim.add([0, 1], max_tokens=2, priority=-1)
    while not fg.is_finished:
        composition(sim)
    left = sim.clock.now
    while sim.clock.now - left < 4.0:  # the hold: still 2 background tokens a step
        assert len(composition(sim)) == 2
    assert len(composition(sim)) == 6  # then the whole batch again


def test_protection_is_off_at_zero_and_under_fcfs():
    for policy, lower in (("priority", 0), ("fcfs", 3)):
        sim = psim(num_blocks=256, bs=4, max_seqs=16, budget=64, policy=policy, lower=lower)
        for i in range(5):
            sim.add([i % 3, 1], max_tokens=20)
        steps(sim, 1)
        sim.add([0, 1], max_tokens=20, priority=-1)
        assert len(composition(sim)) == 6


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(1, 5), st.lists(st.integers(1, 30), min_size=8,
                                                       max_size=8), st.data())
def test_background_progresses_under_endless_urgent_work(num_bg, lower, lengths, data):
    """An urgent request is always live; every decoding background request still gets a
    token within as many steps as there are background requests (each other one takes at
    most one turn before it: round-robin, admissions included), and all of them finish
    (none lost, no block leaked)."""
    sim = psim(num_blocks=512, bs=2, max_seqs=12, budget=64, lower=lower, hold=2.0)
    bg = [sim.add([i % 3, 1, 2][:1 + i % 3], max_tokens=lengths[i]) for i in range(num_bg)]
    waits: dict[int, int] = {}
    urgent = None
    for _ in range(10 * sum(lengths)):
        if urgent is None or urgent.is_finished:
            prompt = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=9))
            urgent = sim.add(prompt, data.draw(st.integers(1, 6)), priority=-1)
        before = [s for s in sim.sched.running if s.params.priority == 0 and at_decode(s)]
        batch = sim.sched.schedule()
        served = {id(i.seq) for i in batch}
        waits = {id(s): 0 if id(s) in served else waits.get(id(s), 0) + 1 for s in before}
        for s in before:
            assert waits[id(s)] < num_bg, f"{s.request_id} waited {waits[id(s)]} steps"
        sim.clock.now += 1
        sim.run_model(batch)
        sim.check()
        if all(s.is_finished for s in bg):
            break
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in bg)
    sim.sched.finish(urgent, "abort")
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_engine_config_protection_defaults_and_bad_values():
    assert (EngineConfig().priority_lower_tokens, EngineConfig().priority_hold_s) == (0, 5.0)
    cfg = EngineConfig(priority_lower_tokens=8)
    sched = scheduler_for(BlockManager(8, 4, False), cfg, None)
    assert (sched.priority_lower_tokens, sched.priority_hold_s) == (
        cfg.priority_lower_tokens, cfg.priority_hold_s)
    for field, value in (("priority_lower_tokens", -1), ("priority_lower_tokens", 1.5),
                         ("priority_hold_s", -2.0), ("priority_hold_s", True)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})


# -- the prefill cap while decoding ---------------------------------------------------------

@pytest.mark.parametrize("policy", ["priority", "fcfs"])
@pytest.mark.parametrize("cap,per_step", [(6, 6), (1, 4), (0, 48)])
def test_prefill_cap_while_decoding_and_progress(policy, cap, per_step):
    sim = psim(num_blocks=64, bs=4, max_seqs=4, budget=64, policy=policy, cap=cap)
    decodes = [sim.add([i, 1], max_tokens=40) for i in range(3)]
    steps(sim, 1)
    assert all(at_decode(s) for s in decodes)
    long = sim.add([1, 2, 0] * 16, max_tokens=1)  # 48 prompt tokens
    done = 0
    while not long.is_finished:
        batch = sim.sched.schedule()
        chunk = {id(i.seq): i.num_tokens for i in batch}
        assert all(chunk.get(id(s)) == 1 for s in decodes), "a decode was held back"
        # the cap (at least a block) every step until the prompt is done: never starved
        assert chunk[id(long)] == min(per_step, 48 - done)
        done += chunk[id(long)]
        sim.run_model(batch)
        sim.clock.now += 1
    assert done == 48


def test_prefill_cap_does_not_apply_without_decodes():
    sim = psim(num_blocks=64, bs=4, max_seqs=4, budget=64, cap=4)
    a = sim.add([1, 2, 0] * 8, max_tokens=2)
    b = sim.add([2, 0, 1] * 8, max_tokens=2)
    batch = sim.sched.schedule()
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 24), (b, 24)]


# -- bookkeeping ----------------------------------------------------------------------------

def test_wait_reasons_and_first_scheduled_time():
    sim = psim(num_blocks=4, bs=2, max_seqs=2, budget=3)
    a = sim.add([0, 1, 2], max_tokens=4)
    b = sim.add([1, 0, 2], max_tokens=4)
    c = sim.add([1, 1], max_tokens=4)
    steps(sim, 1)  # t=0: a's prompt takes the whole budget
    assert a.first_scheduled_time == 0.0 and a.wait_reason == ""
    assert b.wait_reason == c.wait_reason == "budget" and b.first_scheduled_time is None
    steps(sim, 1)  # t=1: a decodes, b gets the 2 tokens left
    assert b.first_scheduled_time == 1.0 and c.wait_reason == "budget"
    steps(sim, 1)  # t=2: a and b each need a block, one is free: b (the later) goes
    assert b.wait_reason == "preempted" and c.wait_reason == "memory"
    assert b.first_scheduled_time == 1.0  # the first time, kept
    assert sim.sched.preemptions_by_reason == {"memory": 1, "priority": 0}
    assert sim.sched.waiting_by_priority() == {0: 2}
    sim.drain()
    sim.check_completed()


def test_reconfigure_in_place_keeps_and_reorders_the_queues():
    sim = psim(max_seqs=1, policy="fcfs")
    a = sim.add([0, 1], max_tokens=3, priority=2)
    b = sim.add([1, 1], max_tokens=3, priority=1)
    c = sim.add([2, 1], max_tokens=3, priority=-1)
    steps(sim, 1)
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b, c]
    blocks = list(a.block_table)
    sim.sched.configure("priority", 0.0, 0)
    assert sim.sched.running == [a] and a.block_table == blocks
    assert list(sim.sched.waiting) == [c, b]
    sim.sched.configure("fcfs", 0.0, 0)
    assert list(sim.sched.waiting) == [c, b]
    with pytest.raises(ValueError, match="scheduling policy 'lifo'"):
        sim.sched.configure("lifo", 0.0, 0)
    assert finish_order(sim) == [a.request_id, c.request_id, b.request_id]


@pytest.mark.parametrize("field,value,match", [
    ("scheduling_policy", "lifo", "scheduling_policy='lifo' is invalid.*fcfs"),
    ("priority_aging_s", -1.0, "priority_aging_s=-1.0 is invalid"),
    ("priority_aging_s", float("nan"), "priority_aging_s=nan is invalid"),
    ("priority_aging_s", True, "priority_aging_s=True is invalid"),
    ("max_prefill_tokens_while_decoding", -1, "max_prefill_tokens_while_decoding=-1"),
    ("max_prefill_tokens_while_decoding", 2.5, "max_prefill_tokens_while_decoding=2.5"),
])
def test_config_refuses_bad_scheduling_settings(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_cli_flags_reach_the_config():
    import argparse

    from kvscope.engine.cli.options import add_engine_options, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_options(p)
    cfg = engine_config_from_args(p.parse_args([]))
    assert (cfg.scheduling_policy, cfg.priority_aging_s,
            cfg.max_prefill_tokens_while_decoding) == ("priority", 60.0, 32)
    cfg = engine_config_from_args(p.parse_args(
        ["--scheduling-policy", "fcfs", "--priority-aging-s", "2.5",
         "--max-prefill-tokens-while-decoding", "0", "--priority-lower-tokens", "7",
         "--priority-hold-s", "1.5"]))
    assert (cfg.scheduling_policy, cfg.priority_aging_s,
            cfg.max_prefill_tokens_while_decoding) == ("fcfs", 2.5, 0)
    assert (cfg.priority_lower_tokens, cfg.priority_hold_s) == (7, 1.5)
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduling-policy", "lifo"])


# -- "priority" with equal priorities is "fcfs" ----------------------------------------------

sim_configs = st.tuples(
    st.integers(4, 24),  # num_blocks
    st.sampled_from([1, 2, 4]),  # block_size
    st.booleans(),  # prefix caching
    st.integers(1, 5),  # max_num_seqs
    st.sampled_from([1, 2, 3, 5, 8, 64]),  # max_num_batched_tokens
    st.sampled_from([0, 1, 3, 8]),  # max_prefill_tokens_while_decoding
    st.sampled_from([0, 1, 2, 5]),  # priority_lower_tokens
    st.sampled_from([0.0, 3.0]),  # priority_hold_s
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sim_configs, st.floats(0.0, 5.0), st.data())
def test_equal_priorities_schedule_exactly_as_fcfs(config, aging, data):
    """Protected steps too: they need two priorities."""
    num_blocks, bs, caching, max_seqs, budget, cap, lower, hold = config
    sims = [psim(num_blocks, bs, caching, max_seqs, budget, 3, policy, aging, cap, lower, hold)
            for policy in ("fcfs", "priority")]
    capacity = num_blocks * bs
    arrivals = data.draw(st.lists(
        st.tuples(st.integers(0, 4), st.lists(st.integers(0, 2), min_size=1, max_size=12),
                  st.integers(1, 12)), min_size=1, max_size=10))
    schedules: list[list[list[tuple[int, int]]]] = [[], []]
    for gap, prompt, max_tokens in arrivals:
        for sim in sims:
            sim.add(prompt[:capacity - 1], max_tokens)
        for _ in range(gap):
            for sim, out in zip(sims, schedules, strict=True):
                out.append(trace_step(sim))
    while any(sim.sched.has_unfinished() for sim in sims):
        for sim, out in zip(sims, schedules, strict=True):
            out.append(trace_step(sim))
        assert len(schedules[0]) < 5000
    assert schedules[0] == schedules[1]
    assert sims[0].sched.preemptions_by_reason == sims[1].sched.preemptions_by_reason
    assert sims[1].sched.preemptions_by_reason["priority"] == 0
    for sim in sims:
        sim.check_completed()


def trace_step(sim: PSim) -> list[tuple[int, int]]:
    sim.step()
    sim.check()
    return sim.history[-1]


# -- random priorities, aborts and reconfigures ---------------------------------------------

class PriorityMachine(RuleBasedStateMachine):
    @initialize(config=sim_configs, policy=st.sampled_from(["priority", "fcfs"]),
                aging=st.sampled_from([0.0, 0.0, 2.0]))
    def setup(self, config, policy, aging):
        num_blocks, bs, caching, max_seqs, budget, cap, lower, hold = config
        self.sim = psim(num_blocks, bs, caching, max_seqs, budget, 3, policy, aging, cap,
                        lower, hold)
        self.aborted = False

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20),
          max_tokens=st.integers(1, 12), priority=st.integers(-2, 2),
          age=st.sampled_from([0.0, 0.0, 0.0, 3.0]))
    def add(self, prompt, max_tokens, priority, age):
        self.sim.add(prompt[:self.sim.capacity - 1], max_tokens, priority, age)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        steps(self.sim, n)

    @rule(seconds=st.floats(0.0, 10.0))
    def wait(self, seconds):
        self.sim.clock.now += seconds

    @precondition(lambda self: hasattr(self, "sim") and self.sim.live())
    @rule(data=st.data())
    def abort(self, data):
        self.sim.abort(data.draw(st.sampled_from(self.sim.live())))
        self.aborted = True

    @rule(policy=st.sampled_from(["priority", "fcfs"]), aging=st.sampled_from([0.0, 3.0]),
          cap=st.sampled_from([0, 2, 5]), lower=st.sampled_from([0, 1, 4]),
          hold=st.sampled_from([0.0, 2.0]))
    def reconfigure_in_place(self, policy, aging, cap, lower, hold):
        sched = self.sim.sched
        live = {id(s) for s in self.sim.live()}
        blocks = {id(s): list(s.block_table) for s in sched.running}
        sched.configure(policy, aging, cap, lower, hold)
        assert {id(s) for s in (*sched.running, *sched.waiting)} == live
        assert {id(s): list(s.block_table) for s in sched.running} == blocks

    @rule(num_blocks=st.integers(4, 24), bs=st.sampled_from([1, 2, 4]), caching=st.booleans(),
          max_seqs=st.integers(1, 5), budget=st.sampled_from([1, 3, 8, 64]),
          policy=st.sampled_from(["priority", "fcfs"]))
    def rebuild(self, num_blocks, bs, caching, max_seqs, budget, policy):
        sim = self.sim
        longest = max((s.num_tokens for s in sim.live()), default=0)
        num_blocks = max(num_blocks, -(-(longest + 1) // bs))  # as _check_pool_holds
        cfg = EngineConfig(num_kv_blocks=num_blocks, block_size=bs, max_num_seqs=max_seqs,
                           max_num_batched_tokens=budget, enable_prefix_caching=caching,
                           scheduling_policy=policy, priority_aging_s=sim.sched.priority_aging_s,
                           max_prefill_tokens_while_decoding=0)
        total = sim.sched.num_preemptions
        sim.rebuild(num_blocks, bs, caching, cfg)
        sim.sched.clock = sim.clock
        assert sim.sched.num_preemptions == total
        sim.recomputed = sim.sched.recomputed_tokens

    @invariant()
    def consistent(self):
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.drain()
            if not self.aborted:
                self.sim.check_completed()
            by_reason = self.sim.sched.preemptions_by_reason
            assert sum(by_reason.values()) == self.sim.sched.num_preemptions


PriorityMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPriorityMachine = PriorityMachine.TestCase


# -- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvscope.testing.tiny_models import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5))


def finish_order_of(engine, background: int, urgent_priority: int):
    """Saturate max_num_seqs with priority-0 requests, then send one more at
    urgent_priority; the request ids in the order they finished, and every reply."""
    from tests.engine.test_engine_tiny import random_prompts

    prompts = random_prompts([9, 14, 11, 7, 12][:background] + [10], seed=8)
    slow = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, slow, request_id=f"bg{i}")
           for i, p in enumerate(prompts[:-1])]
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == engine.config.max_num_seqs
    ids.append(engine.add_request(prompts[-1], SamplingParams(
        max_tokens=4, ignore_eos=True, priority=urgent_priority), request_id="urgent"))
    order = []
    while engine.has_unfinished():
        order += [d.request_id for d in engine.step().outputs if d.finished]
    return order, {i: engine.pop_output(i).token_ids for i in ids}


def test_engine_urgent_request_overtakes_a_saturated_batch(tiny):
    import torch

    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.loader import load_model

    loaded = load_model(tiny, torch.float32)
    cfg = EngineConfig(model=tiny, block_size=8, num_kv_blocks=64, max_num_seqs=2)
    engine = LLMEngine(cfg, loaded=loaded)
    order, replies = finish_order_of(engine, 4, urgent_priority=-1)
    assert order[0] == "urgent"
    assert engine.scheduler.preemptions_by_reason == {"memory": 0, "priority": 1}
    assert engine.scheduler.recomputed_tokens > 0  # bg1's prompt and first tokens, again
    # under fcfs the same request waits for the whole batch; every reply is the same
    fcfs = LLMEngine(EngineConfig(model=tiny, block_size=8, num_kv_blocks=64, max_num_seqs=2,
                                  scheduling_policy="fcfs"), loaded=loaded)
    fcfs_order, fcfs_replies = finish_order_of(fcfs, 4, urgent_priority=-1)
    assert fcfs_order[-1] == "urgent" and fcfs.scheduler.num_preemptions == 0
    assert replies == fcfs_replies


def test_engine_reconfigures_the_policy_in_place(tiny):
    from kvscope.engine.llm_engine import RECONFIGURABLE, LLMEngine

    assert {"scheduling_policy", "priority_aging_s",
            "max_prefill_tokens_while_decoding"} <= RECONFIGURABLE
    engine = LLMEngine(EngineConfig(model=tiny, block_size=8, num_kv_blocks=64,
                                    max_num_seqs=1, scheduling_policy="fcfs"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.add_request([5, 6, 7, 8, 9], params)
    late = engine.add_request([9, 8, 7], SamplingParams(max_tokens=6, ignore_eos=True,
                                                        priority=-1))
    engine.step()
    pool, sched, seq = engine.pool, engine.scheduler, engine.requests[first]
    table = list(seq.block_table)
    engine.reconfigure(scheduling_policy="priority", priority_aging_s=0)
    assert engine.pool is pool and engine.scheduler is sched and seq.block_table == table
    assert engine.config.scheduling_policy == "priority"
    assert engine.config.settings().scheduling_policy == "priority"
    engine.step()  # the urgent one displaces the one that was running
    assert [s.request_id for s in sched.running] == [late]
    assert sched.preemptions_by_reason["priority"] == 1
    # a pool change rebuilds, and the counters carry over
    engine.reconfigure(block_size=4, scheduling_policy="fcfs")
    assert engine.scheduler is not sched and engine.scheduler.policy == "fcfs"
    assert engine.scheduler.preemptions_by_reason["priority"] == 1
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        engine.reconfigure(scheduling_policy="lifo")
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_output(first).token_ids) == len(engine.pop_output(late).token_ids) == 6
