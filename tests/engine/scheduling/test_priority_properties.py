"""Priority scheduling as properties: with equal priorities it schedules exactly as fcfs, and
a state machine of random priorities, aborts and reconfigures never leaks or loses a request.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvscope.engine.config import EngineConfig
from tests.engine.scheduling.priority_sim import (
    PSim,
    psim,
    steps,
)

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
