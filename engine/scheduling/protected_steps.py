"""The protected step's allowance for less urgent work (Scheduler, priority_lower_tokens > 0).

A protected step carries `priority_lower_tokens` tokens of the less urgent work while the
engine's cost model is still learning (or at a stretch of 1); once it is fitted, what the
step's predicted time allows within `priority_step_stretch` times the urgent work's own
(engine/scheduling/step_cost.py: the seconds a decode or a prompt chunk adds, learned from the steps
run), and at least one turn. The tokens were a floor under the seconds until an AVX2 CPU,
where 8 prompt tokens cost 4x the chat's own step. A step in which urgent work waits or
prefills carries one token (a new chat's first token waits for it). The allowance is handed
out round-robin, before the step is formed: each less urgent running request whose
turn it is gets a promise of its next tokens, and the less urgent head of the waiting queue,
when its turn comes, a reserve for its admission. A promise is kept for its own request only:
a less urgent request admitted in the same step (one that sorts before a running one, or
comes after the reserved head) takes only what no turn was promised, so the step never goes
over the allowance and no request's turn is spent by another.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvscope.engine.scheduling.step_cost import StepCost
from kvscope.engine.sequence import Sequence


@dataclass(slots=True)
class TimeAllowance:
    """Seconds of predicted work a protected step may still add beyond its token allowance;
    a prompt chunk's turn is worth at most `chunk_cap` tokens (the step's prefill cap)."""

    cost: StepCost
    seconds: float
    chunk_cap: int

    def take(self, seq: Sequence, want: int) -> int:
        """Tokens of seq's next `want` that fit in what is left (not charged)."""
        if want > 1:
            want = min(want, self.chunk_cap)
        return self.cost.tokens_within(seq.num_computed_tokens, want, self.seconds)

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        self.seconds -= self.cost.work_seconds(seq.num_computed_tokens, num_tokens)


@dataclass(slots=True)
class LowerAllowance:
    """What is left of one protected step's allowance, and whom it is promised to."""

    free: int = 0  # promised to no one: any less urgent work may take it
    reserve: int = 0  # for the less urgent waiting head whose turn it is
    promised: dict[Sequence, int] = field(default_factory=dict)  # running request -> tokens

    def for_running(self, seq: Sequence) -> int:
        """What running seq may take now: its promise and the free rest (0: not its turn)."""
        if seq not in self.promised:
            return 0
        return self.promised[seq] + self.free

    def spend_running(self, seq: Sequence, num_tokens: int) -> None:
        """seq took num_tokens (at most for_running(seq)): its promise first."""
        own = self.promised.pop(seq)
        self.free -= max(0, num_tokens - own)

    def skip_running(self, seq: Sequence) -> None:
        """seq's turn came but it took nothing (no prefill room, no blocks): its promise is
        free for whoever follows in this step."""
        self.free += self.promised.pop(seq, 0)

    def for_admission(self) -> int:
        """What a less urgent admission may take: the reserve and the free rest."""
        return self.reserve + self.free

    def spend_admission(self, num_tokens: int) -> None:
        """An admission took num_tokens (at most for_admission()): the reserve first."""
        from_reserve = min(num_tokens, self.reserve)
        self.reserve -= from_reserve
        self.free -= num_tokens - from_reserve


@dataclass(slots=True)
class Turns:
    """The round-robin's memory: when each less urgent running request last had its turn (a
    stamp, rising with each turn handed out)."""

    last: dict[Sequence, int] = field(default_factory=dict)
    stamps: Iterator[int] = field(default_factory=itertools.count)

    def forget(self, seq: Sequence) -> None:
        self.last.pop(seq, None)


def step_allowance(urgent: int, running: list[Sequence], waiting_head: Sequence | None,
                   turns: Turns, *, lower_tokens: int, stretch: float, cost: StepCost,
                   prefill_left: int) -> LowerAllowance:
    """A protected step's allowance for the work less urgent than `urgent`: one token while
    urgent work waits or prefills (a new chat's first token waits for that step, and 8 less
    urgent decodes in it were a third of the chat's TTFT on an AVX2 CPU); else lower_tokens
    while the cost model learns or at a stretch of 1, the seconds the stretch allows once
    it is fitted. waiting_head, the waiting queue's head, takes turns when it is less
    urgent."""
    urgent_waits = waiting_head is not None and waiting_head.params.priority <= urgent
    head = None if urgent_waits else waiting_head
    lower = [s for s in running if s.params.priority > urgent]
    mine = [s for s in running if s.params.priority <= urgent]
    if urgent_waits or any(s.num_tokens - s.num_computed_tokens != 1 for s in mine):
        return hand_out_turns(1, lower, head, turns)
    within = None
    if stretch > 1.0 and cost.ready:  # (stretch - 1) x what the urgent decodes cost alone
        alone = cost.fixed_seconds + sum(cost.work_seconds(s.num_computed_tokens, 1)
                                         for s in mine)
        within = TimeAllowance(cost, (stretch - 1.0) * alone, prefill_left)
    return hand_out_turns(lower_tokens, lower, head, turns, within)


def hand_out_turns(allowance: int, lower_running: list[Sequence], lower_head: Sequence | None,
                   turns: Turns, within: TimeAllowance | None = None) -> LowerAllowance:
    """Promise the step's allowance to the less urgent requests whose last turn is the longest
    ago (a decode is a token, a prefill chunk up to all of it); lower_head, the waiting queue's
    head when it is less urgent, takes part (else the running ones' decodes would spend every
    allowance and it would wait, and the urgent requests queued behind it, until they
    finished). Records the next of `turns.stamps` (rising) as the last turn of each one served, in
    the order served: two served in one step are not tied in the next, so the order rotates
    even when the allowance does not divide their number. `within`: the seconds the step may
    add, in place of the `allowance` tokens (None while the model is still learning, at a
    stretch of 1); each turn takes what the seconds left allow, the first at least one
    token, however long it takes."""
    candidates = list(lower_running)
    if lower_head is not None:
        candidates.append(lower_head)
    last_turn = turns.last
    candidates.sort(key=lambda s: last_turn.get(s, -1))
    result = LowerAllowance()
    left = allowance if within is None else 0
    served = False
    for seq in candidates:
        want = seq.num_tokens - seq.num_computed_tokens
        if within is None:
            if left <= 0:
                break
            take = min(left, want)
        else:
            if served and within.seconds <= 0:
                break
            take = within.take(seq, want)
            if not served:  # one turn a step whatever the seconds: nothing less urgent starves
                take = max(take, min(1, want))
            within.charge(seq, take)
        if take <= 0:
            continue
        served = True
        last_turn[seq] = next(turns.stamps)
        if seq is lower_head:
            result.reserve = take
        else:
            result.promised[seq] = take
        left -= take
    result.free = max(left, 0)
    return result
