"""The protected step's allowance for less urgent work (Scheduler, priority_lower_tokens > 0).

A protected step carries at most `priority_lower_tokens` tokens of the less urgent work. They
are handed out round-robin before the step is formed: each less urgent running request whose
turn it is gets a promise of its next tokens, and the less urgent head of the waiting queue,
when its turn comes, a reserve for its admission. A promise is kept for its own request only:
a less urgent request admitted in the same step (one that sorts before a running one, or
comes after the reserved head) takes only what no turn was promised, so the step never goes
over the allowance and no request's turn is spent by another.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvscope.engine.sequence import Sequence


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


def hand_out_turns(allowance: int, lower_running: list[Sequence], lower_head: Sequence | None,
                   last_turn: dict[Sequence, int], stamps: Iterator[int]) -> LowerAllowance:
    """Promise the step's allowance to the less urgent requests whose last turn is the longest
    ago (a decode is a token, a prefill chunk up to all of it); lower_head, the waiting queue's
    head when it is less urgent, takes part (else the running ones' decodes would spend every
    allowance and it would wait, and the urgent requests queued behind it, until they
    finished). Records the next of `stamps` (rising) as the last turn of each one served, in
    the order served: two served in one step are not tied in the next, so the order rotates
    even when the allowance does not divide their number."""
    candidates = list(lower_running)
    if lower_head is not None:
        candidates.append(lower_head)
    candidates.sort(key=lambda s: last_turn.get(s, -1))
    result = LowerAllowance()
    left = allowance
    for seq in candidates:
        if left <= 0:
            break
        take = min(left, seq.num_tokens - seq.num_computed_tokens)
        if take <= 0:
            continue
        last_turn[seq] = next(stamps)
        if seq is lower_head:
            result.reserve = take
        else:
            result.promised[seq] = take
        left -= take
    result.free = left
    return result
