"""Priority scheduling: admission order, preemption for priority, aging, the prefill cap
while decoding, and the bookkeeping (wait reasons, reconfigure, config and CLI checks).

The tests drive the Scheduler and a real BlockManager without a model, through the shadow-KV
simulation of test_scheduler_properties (tests/engine/scheduling/priority_sim.py): a block shared
with the wrong prefix or reused while still read shows up as a wrong value read back. Times come
from a fake clock."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.config import EngineConfig
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sequence import Sequence, SequenceStatus
from tests.engine.scheduling.priority_sim import (
    PSim,
    at_decode,
    finish_order,
    psim,
    steps,
)

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


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_chats_prefix_cache_outlives_the_background_under_priority(policy):
    """Under "priority" a finished chat's cached prompt blocks are evicted after those of a
    background request that finished later; under fcfs (priority ignored) least recently
    released first, so the chat's go first."""
    sim = psim(num_blocks=12, bs=2, caching=True, max_seqs=4, policy=policy)
    chat = sim.add([0, 1, 2, 1, 0], max_tokens=1, priority=-1)
    sim.drain()
    bg = sim.add([2, 2, 1, 1, 0], max_tokens=1)
    sim.drain()
    assert sim.bm.num_cached_free_blocks == 4  # two full prompt blocks each
    assert sim.bm.num_free_blocks - sim.bm.num_cached_free_blocks == 8
    sim.add([1, 0, 0, 2, 2, 1, 0, 1, 2, 0, 1, 0, 2, 1, 1, 0, 0, 1, 2], max_tokens=1)  # 10 blocks
    sim.drain()
    probe = {name: Sequence(name, list(s.prompt_token_ids), SamplingParams())
             for name, s in (("chat", chat), ("bg", bg))}
    kept = {name: len(sim.bm.match_prefix(s)) for name, s in probe.items()}
    assert kept == ({"chat": 2, "bg": 0} if policy == "priority" else {"chat": 0, "bg": 2})
    other = "fcfs" if policy == "priority" else "priority"  # switched in place, as a reconfigure
    sim.sched.configure(other, 0.0, 0)
    assert sim.bm.evict_by_priority == (other == "priority")
