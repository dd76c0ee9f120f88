"""Protected steps (priority_lower_tokens, priority_hold_s): while urgent work is live, a step
carries at most a few tokens of the rest, round-robin, and nothing starves.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.scheduling.scheduler import scheduler_for
from kvscope.engine.scheduling.step_cost import MIN_STEPS, StepCost, step_shape
from kvscope.engine.sequence import Sequence
from tests.engine.scheduling.priority_sim import (
    PSim,
    at_decode,
    psim,
    steps,
)

# -- protected steps (priority_lower_tokens, priority_hold_s) ---------------------------------

def decoding_sim(num_bg: int, lower: int, hold: float = 0.0, cap: int = 0,
                 max_tokens: int = 200, stretch: float = 1.0,
                 cost: StepCost | None = None) -> tuple[PSim, list[Sequence]]:
    """num_bg priority-0 requests, all decoding (so no step has prefill work yet)."""
    sim = psim(num_blocks=256, bs=4, max_seqs=16, budget=64, lower=lower, hold=hold, cap=cap,
               stretch=stretch, cost=cost)
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
    assert first[fg.request_id] == 3 and sum(first.values()) == 4  # its prefill + 1 other
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
    steps(sim, 2)  # its prefill (one background turn), then a decode (both had theirs)
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


# fixed 6 ms, 2 ms a row, 1 ms per 1k decode keys, 2 ms per 10k chunk keys
COST = (0.006, 0.002, 0.001, 0.002)


def test_time_allowance_fills_the_step_up_to_the_stretch():
    """With a fitted model and a stretch of 3, a protected step carries less urgent work up to
    twice what the urgent decode costs alone (fixed part and its row), in place of the 2
    tokens; at a stretch of 1, the 2 tokens only. The urgent prefill's step carries one token
    at every stretch. The turns still rotate."""
    for stretch, per_step in ((1.0, 2), (3.0, 7)):
        sim, bg = decoding_sim(12, lower=2, stretch=stretch, cost=StepCost(coef=COST))
        fg = sim.add([0, 1, 2], max_tokens=40, priority=-1)
        first = composition(sim)  # the urgent prefill, a new chat's first token waits for
        assert first.pop(fg.request_id) == 3 and sum(first.values()) == 1
        counts = dict.fromkeys((s.request_id for s in bg), 0)
        for _ in range(12):
            starts = {s.request_id: s.num_computed_tokens for s in sim.sched.running}
            step = composition(sim)
            shape = step_shape((starts[rid], n) for rid, n in step.items())
            assert step.pop(fg.request_id) == 1
            assert len(step) == per_step and set(step.values()) == {1}
            alone = COST[0] + StepCost(coef=COST).work_seconds(starts[fg.request_id], 1)
            if stretch > 1:
                assert StepCost(coef=COST).predict(shape) <= stretch * alone + 1e-9
            for rid in step:
                counts[rid] += 1
        assert max(counts.values()) - min(counts.values()) <= 1  # round-robin


def test_the_token_allowance_yields_to_the_seconds_once_the_model_is_fitted():
    """Where the less urgent tokens cost more than the stretch allows (8 prompt tokens were 4x
    a chat's own step on an AVX2 CPU), a protected step carries what the seconds allow, one
    token at least, rather than the 8: the step stays near the stretch, the prompt still
    advances every step."""
    slow = (0.006, 0.004, 0.0, 0.0)  # 6 ms fixed, 4 ms a row: 8 prompt rows = 32 ms
    for stretch, most in ((1.0, 8), (1.5, 1), (3.0, 5)):
        sim, _ = decoding_sim(0, lower=8, cap=64, stretch=stretch, cost=StepCost(coef=slow))
        # (decoding_sim(0): the prompt is the only less urgent work)
        chunks = prompt_chunks_beside_a_chat(sim, [0, 1, 2] * 20, steps=6)
        # stretch 1: the tokens (the old rule); 1.5: 5 ms spare, one 4 ms row, the guaranteed
        # turn; 3: 20 ms, 5 rows
        assert chunks == [most] * 6, (stretch, chunks)


def test_time_allowance_starts_once_the_model_has_seen_enough_steps():
    """Protected steps carry the tokens only until the scheduler's own model has observed
    MIN_STEPS steps; from the next step on they fill to the stretch."""
    sim, _ = decoding_sim(12, lower=2, stretch=3.0)
    fg = sim.add([0, 1, 2], max_tokens=200, priority=-1)
    composition(sim)  # the urgent prefill
    cost = sim.sched.step_cost
    for _ in range(MIN_STEPS):
        assert not cost.ready
        assert sum(composition(sim).values()) == 1 + 2
        # what a machine like the one COST describes would have timed (0.5 ms rows)
        cost.observe(step_shape([(0, 1)] * (1 + len(cost.observed_seconds) % 9)),
                     COST[0] + 0.0005 * (1 + len(cost.observed_seconds) % 9))
    assert cost.ready
    step = composition(sim)
    assert step.pop(fg.request_id) == 1 and len(step) > 2


def test_the_every_step_model_stands_in_until_the_protected_one_is_fitted():
    """Before MIN_STEPS protected steps, the model of every step (fitted on its relative
    error) sets the time allowance in place of the tokens; once the protected steps' model
    is fitted, that one does."""
    sim, _ = decoding_sim(12, lower=2, stretch=3.0)
    sim.sched.every_step_cost = StepCost(coef=COST, relative=True)
    fg = sim.add([0, 1, 2], max_tokens=200, priority=-1)
    composition(sim)  # the urgent prefill
    assert not sim.sched.step_cost.ready
    step = composition(sim)
    assert step.pop(fg.request_id) == 1 and len(step) == 7  # COST at a stretch of 3: 7 rows
    sim.sched.step_cost = StepCost(coef=(0.006, 0.006, 0.0, 0.0))  # 2 x 12 ms: 4 6-ms rows
    step = composition(sim)
    assert step.pop(fg.request_id) == 1 and len(step) == 4


def test_time_allowance_respects_the_prefill_cap_for_a_chunk():
    """A less urgent prompt's chunk takes the seconds left, at most the step's prefill cap."""
    sim, bg = decoding_sim(1, lower=1, cap=4, stretch=6.0,
                           cost=StepCost(coef=(0.006, 0.0005, 0.0, 0.0)))
    chunks = prompt_chunks_beside_a_chat(sim, [0, 1, 2] * 10, steps=4)
    assert max(chunks) == 4 and sum(chunks) >= 8


def prompt_chunks_beside_a_chat(sim: PSim, prompt: list[int], steps: int) -> list[int]:
    """An urgent chat (its prefill step run), then a less urgent prompt: the prompt's tokens
    in each of the next `steps` protected steps, each of which gives the chat its token."""
    fg = sim.add([0, 1, 2], max_tokens=40, priority=-1)
    composition(sim)  # the urgent prefill
    seq = sim.add(prompt, max_tokens=5)
    chunks = []
    for _ in range(steps):
        step = composition(sim)
        assert step.pop(fg.request_id) == 1
        chunks.append(step.get(seq.request_id, 0))
    return chunks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(1, 5), st.lists(st.integers(1, 30), min_size=8,
                                                       max_size=8), st.sampled_from([1.0, 3.0]),
       st.data())
def test_background_progresses_under_endless_urgent_work(num_bg, lower, lengths, stretch, data):
    """An urgent request is always live; every decoding background request still gets a
    token within as many steps as there are background requests (each other one takes at
    most one turn before it: round-robin, admissions included), and all of them finish
    (none lost, no block leaked), with or without a time allowance."""
    sim = psim(num_blocks=512, bs=2, max_seqs=12, budget=64, lower=lower, hold=2.0,
               stretch=stretch, cost=StepCost(coef=COST))
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
    cfg = EngineConfig()
    assert (cfg.priority_lower_tokens, cfg.priority_hold_s, cfg.priority_step_stretch) == (
        8, 0.0, 2.0)
    assert EngineConfig(priority_step_stretch=3).priority_step_stretch == 3.0
    cfg = EngineConfig(priority_lower_tokens=4)
    sched = scheduler_for(BlockManager(8, 4, False), cfg, None)
    assert (sched.priority_lower_tokens, sched.priority_hold_s) == (
        cfg.priority_lower_tokens, cfg.priority_hold_s)
    for field, value in (("priority_lower_tokens", -1), ("priority_lower_tokens", 1.5),
                         ("priority_hold_s", -2.0), ("priority_hold_s", True),
                         ("priority_step_stretch", 0.5), ("priority_step_stretch", "2"),
                         ("priority_step_stretch", float("inf"))):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})
