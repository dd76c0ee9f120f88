"""The protected step's allowance: promises are kept for their own request, and whatever the
order of spending, the step never carries more less-urgent tokens than the allowance."""
from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvscope.engine.protected_steps import hand_out_turns
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sequence import Sequence


def seq(name: str, prompt: int, computed: int) -> Sequence:
    s = Sequence(name, [0] * prompt, SamplingParams(max_tokens=4))
    s.num_computed_tokens = computed
    return s


def test_turns_go_to_the_longest_waiting_and_rotate():
    running = [seq(f"r{i}", 3, 2) for i in range(3)]  # decodes: one token each
    last: dict[Sequence, int] = {}
    stamps = itertools.count()
    served = []
    for _ in range(6):
        a = hand_out_turns(2, running, None, last, stamps)
        assert sum(a.promised.values()) == 2 and a.free == 0 and a.reserve == 0
        served += [s.request_id for s in a.promised]
    # round-robin although 2 does not divide 3: every window of 3 tokens serves all three
    for k in range(0, 12, 3):
        assert sorted(served[k:k + 3]) == ["r0", "r1", "r2"], served


def test_the_waiting_head_gets_a_reserve_and_what_is_left_is_free():
    head = seq("h", 5, 0)
    a = hand_out_turns(8, [seq("r", 3, 2)], head, {}, itertools.count())
    assert a.reserve == 5 and a.free == 2 and sum(a.promised.values()) == 1


def test_an_admission_cannot_take_a_promised_turn():
    r = seq("r", 3, 2)
    a = hand_out_turns(1, [r], None, {}, itertools.count())
    assert a.for_admission() == 0  # the only token is r's
    assert a.for_running(r) == 1
    a.spend_running(r, 1)
    assert a.for_running(r) == 0 and a.for_admission() == 0


def test_a_skipped_turn_is_freed_for_the_others():
    r1, r2 = seq("a", 3, 2), seq("b", 3, 2)
    a = hand_out_turns(2, [r1, r2], None, {}, itertools.count())
    a.skip_running(r1)
    assert a.for_admission() == 1 and a.for_running(r2) == 2


@given(st.integers(0, 12), st.lists(st.integers(1, 6), max_size=5), st.integers(0, 6),
       st.lists(st.tuples(st.sampled_from(["run", "skip", "admit"]), st.integers(0, 5),
                          st.integers(1, 9)), max_size=12))
def test_spending_never_exceeds_the_allowance(allowance, left, head_left, ops):
    running = [seq(f"r{i}", n + 1, 1) for i, n in enumerate(left)]
    head = seq("h", head_left, 0) if head_left else None
    a = hand_out_turns(allowance, running, head, {}, itertools.count())
    spent = 0
    for op, index, want in ops:
        if op == "admit":
            n = min(want, a.for_admission())
            a.spend_admission(n)
        elif running:
            s = running[index % len(running)]
            if s not in a.promised:
                continue
            if op == "skip":
                a.skip_running(s)
                continue
            n = min(want, a.for_running(s))
            a.spend_running(s, n)
        else:
            continue
        spent += n
        assert a.free >= 0 and a.reserve >= 0
    assert spent + a.free + a.reserve + sum(a.promised.values()) <= allowance
