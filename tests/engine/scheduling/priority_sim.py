"""The priority tests' simulation: the Scheduler and a real BlockManager without a model, through
the shadow-KV simulation of test_scheduler_properties (Sim), on a fake clock."""
from __future__ import annotations

import itertools
import math

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduling.scheduler import ScheduledSeq, Scheduler, scheduler_for
from kvscope.engine.scheduling.step_cost import StepCost
from kvscope.engine.sequence import Sequence, SequenceStatus
from tests.engine.scheduling.test_scheduler_properties import Sim

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

        self.check_batch(batch)
        for item in batch:
            assert item.seq.wait_reason == "" and item.seq.first_scheduled_time is not None
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

    def finished(self, s: Sequence) -> None:
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

    def drain_limit(self, limit: int) -> int:
        # Not bounded by the work left: priority preemption may throw back the oldest request.
        return max(limit, 20_000)

    def check_completed(self) -> None:
        """Without aborts: every request got max_tokens, or outgrew the pool."""
        capacity_ids = {id(s) for s in self.capacity_finished}
        for s in self.seqs:
            assert s.is_finished and s.finish_reason == "length"
            if id(s) not in capacity_ids:
                assert s.num_output_tokens == s.params.max_tokens


def psim(num_blocks: int = 16, bs: int = 2, caching: bool = False, max_seqs: int = 4,
         budget: int = 64, alphabet: int = 3, policy: str = "priority", aging: float = 0.0,
         cap: int = 0, lower: int = 0, hold: float = 0.0, stretch: float = 1.0,
         cost: StepCost | None = None) -> PSim:
    bm = BlockManager(num_blocks, bs, caching)
    clock = Clock()
    sched = Scheduler(bm, max_seqs, budget, policy=policy, priority_aging_s=aging,
                      max_prefill_tokens_while_decoding=cap, priority_lower_tokens=lower,
                      priority_hold_s=hold, priority_step_stretch=stretch, clock=clock)
    if cost is not None:  # a model already fitted: protected steps get a time allowance
        sched.step_cost = cost
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
