"""Continuous batching: re-form the batch every step under a token budget and a sequence cap.

Running requests go first (a decode is one token; a request still prefilling gets the next
chunk), then waiting requests are admitted with prefill chunks from what is left of the budget.
When the pool runs dry the running request that comes last in the policy's order is preempted
by recompute: its blocks are freed and it goes back to the waiting queue.

Policies (EngineConfig.scheduling_policy):
- "fcfs": arrival order; the victim is the most recently admitted; priority is ignored.
- "priority": one order for everything, by the key (priority, arrival), lower first
  (SamplingParams.priority), aged when priority_aging_s > 0. Running requests are kept in key
  order, so the victim is still the last one: the lowest priority, latest arrival. A waiting
  request that sorts before a running one is admitted before that one gets its chunk (its
  prefill is not stuck behind lower-priority prefills), and one of strictly higher priority
  blocked by max_num_seqs or memory preempts lower-priority running requests when that makes
  room for it ("priority" preemptions).

Under both, when decodes are running the step's prefill tokens are capped
(max_prefill_tokens_while_decoding): a long prefill in the same step would hold every decode's
next token back for its whole chunk.

priority, protected steps (priority_lower_tokens > 0): while a request of strictly higher
priority than others is live (running or waiting), or finished less than priority_hold_s ago,
each step carries priority_lower_tokens tokens of the less urgent work (once a cost model,
engine/scheduling/step_cost.py, is fitted: what keeps the step's predicted time within
priority_step_stretch times what the urgent decodes cost alone, at least one token; one token
while urgent work waits or prefills), handed out round-robin over the less urgent running
requests (then to their admissions), so the step, which every token in it waits for, stays
close to the urgent requests' own step time.
The urgent requests' prefill is not capped by the less urgent decodes. The less urgent head
of the waiting queue takes turns too, so every less urgent running request gets a token
within len(them) + len(waiting) steps (docs/scheduling.md has the measurements and what the
background loses). Under priority the prefix cache also evicts the blocks less urgent
requests left before the more urgent ones' (engine/kv_cache/evictable_blocks.py).
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.scheduling.preemption import REASONS, Preemption, blocks_needed, blocks_released
from kvscope.engine.scheduling.protected_steps import LowerAllowance, Turns, step_allowance
from kvscope.engine.scheduling.step_cost import StepCost
from kvscope.engine.scheduling.waiting_queue import WaitingQueue
from kvscope.engine.sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")
# The EngineConfig fields only the scheduler reads: a reconfigure that changes nothing else
# applies them in place, keeping the pool, its prefix cache and both queues.
SCHEDULING_SETTINGS = frozenset({"scheduling_policy", "priority_aging_s",
                                 "max_prefill_tokens_while_decoding", "priority_lower_tokens",
                                 "priority_hold_s", "priority_step_stretch"})


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    num_draft_tokens: int = 0  # of num_tokens, drafted by engine.spec_decode.decoder (verified)

    @property
    def is_decode(self) -> bool:
        """One new token after an already generated one (anything else is prefill work)."""
        return self.num_tokens - self.num_draft_tokens == 1 and self.seq.num_output_tokens > 0 \
            and self.seq.num_computed_tokens == self.seq.num_tokens - 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, *, policy: str = "fcfs",
                 priority_aging_s: float = 0.0, max_prefill_tokens_while_decoding: int = 0,
                 priority_lower_tokens: int = 0, priority_hold_s: float = 0.0,
                 priority_step_stretch: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock  # first_scheduled_time; tests pass a fake one
        self.policy = "fcfs"
        self.priority_aging_s = 0.0
        self.max_prefill_tokens_while_decoding = 0
        self.priority_lower_tokens = 0
        self.priority_hold_s = 0.0
        self.priority_step_stretch = 1.0
        # What protected steps cost, learned from the ones run (the engine observes each): a
        # protected step's time allowance is in its predicted seconds. Until it is fitted,
        # the same fitted over every step, on its relative error (engine/scheduling/step_cost.py).
        self.step_cost = StepCost()
        self.every_step_cost = StepCost(relative=True)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self._running_priorities: Counter[int] = Counter()  # of the running requests
        self._live_priorities: Counter[int] = Counter()  # of every running or waiting one
        # Protected steps: the urgent priority of this step (None: not protecting) and what
        # is left of its allowance for less urgent work; the hold after more urgent requests
        # left, (priority, when); the round-robin: when each less urgent running request last
        # had its turn (a stamp, rising with each turn handed out).
        self._urgent: int | None = None
        self._allowance = LowerAllowance()
        self._hold: tuple[int, float] | None = None
        self._turns = Turns()
        self._order: dict[Sequence, int] = {}  # ties of arrival_time: the order of add()
        self._keys: dict[Sequence, tuple[float, ...]] = {}
        self._added = 0
        self.num_preemptions = 0
        self.preemptions_by_reason: dict[str, int] = dict.fromkeys(REASONS, 0)
        # Tokens preemption threw away that had to be computed again after prefix-cache hits.
        self.recomputed_tokens = 0
        self.last_preemptions: list[Preemption] = []  # this schedule()'s, oldest first
        self._thrown: dict[Sequence, int] = {}  # preempted, waiting: tokens it had computed
        self._blocked = "budget"  # why the waiting requests wait, as of the last schedule()
        self._marked = "budget"  # the reason _mark_waiting last gave every waiting request
        # Requests finished by the scheduler itself (no room even alone); the engine reports them.
        self.finished_by_capacity: list[Sequence] = []
        self.configure(policy, priority_aging_s, max_prefill_tokens_while_decoding,
                       priority_lower_tokens, priority_hold_s, priority_step_stretch)

    # -- settings --------------------------------------------------------------------------
    def configure(self, policy: str, priority_aging_s: float,
                  max_prefill_tokens_while_decoding: int, priority_lower_tokens: int = 0,
                  priority_hold_s: float = 0.0, priority_step_stretch: float = 1.0) -> None:
        """Change the policy knobs between steps; the queues are kept (and re-sorted)."""
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is invalid: expected one of "
                             f"{POLICIES}")
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.priority_lower_tokens = priority_lower_tokens
        self.priority_hold_s = priority_hold_s
        self.priority_step_stretch = priority_step_stretch
        # what a request leaves in the prefix cache is evicted after less urgent ones' blocks
        self.block_manager.evict_by_priority = policy == "priority"
        if (policy, priority_aging_s) == (self.policy, self.priority_aging_s):
            return
        self.policy, self.priority_aging_s = policy, priority_aging_s
        self._keys = {seq: self._compute_key(seq) for seq in self._order}
        if policy == "priority":
            self.running.sort(key=self._keys.__getitem__)
            self.waiting.reorder(self._keys.__getitem__)
        else:  # fcfs from here on: the running order in force is the admission order
            self.waiting.reorder(None)

    def configure_from(self, config: EngineConfig) -> None:
        self.configure(config.scheduling_policy, config.priority_aging_s,
                       config.max_prefill_tokens_while_decoding, config.priority_lower_tokens,
                       config.priority_hold_s, config.priority_step_stretch)

    def _compute_key(self, seq: Sequence) -> tuple[float, ...]:
        """Lower first. Aged: the effective priority, p - waited / aging_s, ranks two requests
        at any moment as p + arrival / aging_s does, so the order never changes while they wait
        and a sorted queue stays sorted (times aging_s: p * aging_s + arrival)."""
        p, t, n = seq.params.priority, seq.arrival_time, self._order[seq]
        if self.priority_aging_s > 0:
            return (p * self.priority_aging_s + t, t, n)
        return (p, t, n)

    # -- queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._order[seq] = self._added
        self._added += 1
        self._keys[seq] = self._compute_key(seq)
        self._live_priorities[seq.params.priority] += 1
        seq.wait_reason = "preempted" if seq in self._thrown else self._blocked
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_by_priority(self) -> dict[int, int]:
        """How many requests wait at each SamplingParams.priority (the metrics gauge)."""
        counts: dict[int, int] = {}
        for seq in self.waiting:
            p = seq.params.priority
            counts[p] = counts.get(p, 0) + 1
        return counts

    # -- the step --------------------------------------------------------------------------
    @property
    def step_is_protected(self) -> bool:
        """Whether the last schedule() made a protected step (urgent work was live)."""
        return self._urgent is not None

    def schedule(self) -> list[ScheduledSeq]:
        self.last_preemptions = []
        memory_before = self.preemptions_by_reason["memory"]
        scheduled: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        urgent = self._urgent = self._urgent_priority()
        prefill_left = self._prefill_allowance()
        # protected: the less urgent running requests whose turn it is (the rest skip)
        allowance = self._allowance = (LowerAllowance() if urgent is None
                                       else self._step_allowance(urgent, prefill_left))
        above = sys.maxsize if urgent is None else urgent  # less urgent: a priority above it
        running = SequenceStatus.RUNNING
        # priority: a waiting request that sorts before a running one goes before it.
        keys = self._keys
        head = keys[self.waiting.head()] if self.policy == "priority" and self.waiting else None
        if head is not None and self.running and head > keys[self.running[-1]]:
            head = None  # running is in key order: it sorts after all of them
        admitting = True
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted a moment ago to make room for an earlier request
            lower = seq.params.priority > above
            if lower and seq not in allowance.promised:
                continue  # holds its blocks; its turn comes in a later step
            if head is not None and head < keys[seq]:
                budget, prefill_left, admitting = self._admit(scheduled, budget, prefill_left,
                                                              before=seq)
                head = keys[self.waiting.head()] if admitting and self.waiting else None
                if budget == 0:
                    break
                if seq.status is not running:
                    continue  # displaced by a request of higher priority
            start = seq.num_computed_tokens
            num_tokens = len(seq.token_ids) - start
            prefill = num_tokens > 1 or len(seq.token_ids) == len(seq.prompt_token_ids)
            if prefill:  # 0 when prefill_left is: it holds its blocks for a later chunk
                num_tokens = min(num_tokens, budget, prefill_left)
            if lower:
                num_tokens = min(num_tokens, allowance.for_running(seq))
            placed = num_tokens > 0 and self._place(seq, start, num_tokens)
            if self.preemptions_by_reason["memory"] != memory_before:
                head = None  # the pool ran dry: no more admissions in this step
            if not placed:
                if lower:
                    allowance.skip_running(seq)
                continue
            scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
            if prefill:
                prefill_left -= num_tokens
            if lower:
                allowance.spend_running(seq, num_tokens)
        # Admitting new work right after the pool ran dry would only thrash it.
        if self.preemptions_by_reason["memory"] != memory_before:
            self._blocked = "memory"
        elif admitting:
            self._admit(scheduled, budget, prefill_left, before=None)
        self._mark_waiting()
        return scheduled

    def _place(self, seq: Sequence, start: int, num_tokens: int) -> bool:
        """Give running seq the blocks its next num_tokens need (preempting the last running
        requests when the pool is dry); False when seq itself had to go. Runs once per
        running sequence per step, so the block arithmetic is inline and the block manager is
        called only when the chunk needs a block or completes one (for a decode: once every
        block_size steps)."""
        bm = self.block_manager
        bs = bm.block_size
        end = start + num_tokens
        need = -(-end // bs) - len(seq.block_table)  # = bm.num_new_blocks when > 0
        if need > 0:
            if not self._make_room(seq, need):
                return False
            bm.append_blocks(seq, need)
        if bm.enable_prefix_caching and end // bs > start // bs:
            bm.commit_full_blocks(seq, start, end)
        return True

    def _prefill_allowance(self) -> int:
        """Prefill tokens this step may carry: the cap when a decode runs (never less than a
        block, so a prefill always gets somewhere), else the whole budget. In a protected
        step only the urgent decodes count: the less urgent ones are a few tokens of it."""
        cap, urgent = self.max_prefill_tokens_while_decoding, self._urgent
        if cap and any(len(s.token_ids) - s.num_computed_tokens == 1
                       and len(s.token_ids) > len(s.prompt_token_ids)
                       and (urgent is None or s.params.priority <= urgent)
                       for s in self.running):
            return max(cap, self.block_manager.block_size)
        return self.max_num_batched_tokens

    def _urgent_priority(self) -> int | None:
        """The priority a protected step serves first: the most urgent live one (or held, in
        priority_hold_s after such requests left) when some live work is less urgent; None
        when nothing is protected."""
        if self.policy != "priority" or not self.priority_lower_tokens \
                or not self._live_priorities:
            return None
        urgent, least = min(self._live_priorities), max(self._live_priorities)
        if self._hold is not None:
            held, when = self._hold
            if self.clock() - when < self.priority_hold_s:
                urgent = min(urgent, held)
            else:
                self._hold = None
        return urgent if urgent < least else None

    def _step_allowance(self, urgent: int, prefill_left: int) -> LowerAllowance:
        """The protected step's allowance, promised round-robin (protected_steps). The step
        still visits the running requests in their order, so a memory victim (the last) is
        never one it has already scheduled."""
        return step_allowance(urgent, self.running, self.waiting.head() if self.waiting else None,
                              self._turns, lower_tokens=self.priority_lower_tokens,
                              stretch=self.priority_step_stretch, cost=self.cost_model,
                              prefill_left=prefill_left)

    @property
    def cost_model(self) -> StepCost:
        """What a protected step's time is predicted with: the model of protected steps once
        fitted, the one of every step before (not fitted either: the tokens alone)."""
        return self.step_cost if self.step_cost.ready else self.every_step_cost

    def _make_room(self, seq: Sequence, need: int) -> bool:
        """Preempt the last running requests until seq's `need` new blocks are free; False if
        seq itself had to go."""
        while need > self.block_manager.num_free_blocks:
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self.finish_for_capacity(seq)
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, scheduled: list[ScheduledSeq], budget: int, prefill_left: int,
               before: Sequence | None) -> tuple[int, int, bool]:
        """Admit waiting requests in queue order (only those sorting before `before`, when
        given). Returns what is left of the budget and the prefill allowance, and whether
        admission is still open in this step (False: the head is blocked)."""
        bm = self.block_manager
        keys = self._keys
        while self.waiting:
            seq = self.waiting.head()
            if before is not None and not keys[seq] < keys[before]:
                return budget, prefill_left, True
            if budget == 0 or prefill_left == 0:
                self._blocked = "budget"
                return budget, prefill_left, False
            full = len(self.running) >= self.max_num_seqs
            if full and not self._may_displace(seq):
                self._blocked = "max_num_seqs"
                return budget, prefill_left, False
            lower = self._urgent is not None and seq.params.priority > self._urgent
            if lower and self._allowance.for_admission() == 0:
                self._blocked = "budget"  # the protected step's allowance is spent
                return budget, prefill_left, False
            hits = bm.match_prefix(seq)
            num_tokens = min(seq.num_tokens - len(hits) * bm.block_size, budget, prefill_left)
            if lower:
                num_tokens = min(num_tokens, self._allowance.for_admission())
            if full or not bm.can_allocate(seq, hits, num_tokens):
                if not full and not self.running and bm.num_used_blocks == 0:
                    self.waiting.pop_head()
                    self.finish_for_capacity(seq)
                    continue
                self._blocked = "max_num_seqs" if full else "memory"
                if not self._displace_for(seq, hits, num_tokens, full):
                    return budget, prefill_left, False
                # Room made for seq alone: admitting more (a victim even) would thrash.
                self._admit_one(seq, hits, num_tokens, scheduled)
                if lower:
                    self._allowance.spend_admission(num_tokens)
                return budget - num_tokens, prefill_left - num_tokens, False
            self._admit_one(seq, hits, num_tokens, scheduled)
            if lower:
                self._allowance.spend_admission(num_tokens)
            budget -= num_tokens
            prefill_left -= num_tokens
        self._blocked = "budget"  # nothing blocks: an arrival waits for the next step's budget
        return budget, prefill_left, True

    def _admit_one(self, seq: Sequence, hits: list[int], num_tokens: int,
                   scheduled: list[ScheduledSeq]) -> None:
        self.waiting.pop_head()
        self._start(seq, hits, num_tokens)
        scheduled.append(ScheduledSeq(seq, num_tokens))

    def _start(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        bm = self.block_manager
        bm.allocate(seq, hits, num_tokens)
        thrown = self._thrown.pop(seq, 0)
        if thrown:  # what the prefix cache no longer holds of what it had computed
            self.recomputed_tokens += max(0, thrown - len(hits) * bm.block_size)
        seq.status = SequenceStatus.RUNNING
        seq.wait_reason = ""
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
        if self.policy == "priority":
            self._insert_running(seq)
        else:
            self.running.append(seq)
        self._running_priorities[seq.params.priority] += 1
        start = seq.num_computed_tokens
        bm.commit_full_blocks(seq, start, start + num_tokens)

    def _insert_running(self, seq: Sequence) -> None:
        key, keys = self._keys[seq], self._keys
        i = len(self.running)
        while i > 0 and keys[self.running[i - 1]] > key:
            i -= 1
        self.running.insert(i, seq)

    def _may_displace(self, seq: Sequence) -> bool:
        """Whether some running request is one seq could displace (see _displace_for)."""
        if self.policy != "priority" or not self.running:
            return False
        p = seq.params.priority
        if self.priority_aging_s == 0:  # in (priority, arrival) order: the last has the most
            return self.running[-1].params.priority > p
        if max(self._running_priorities) <= p:  # the common case, without a scan
            return False
        key, keys = self._keys[seq], self._keys
        return any(o.params.priority > p and keys[o] > key for o in self.running)

    def _displace_for(self, seq: Sequence, hits: list[int], num_tokens: int,
                      full: bool) -> bool:
        """priority: preempt running requests of strictly lower priority (latest in the order
        first) when, and only when, that lets seq in; True if it did."""
        if self.policy != "priority":
            return False
        keys, key, p = self._keys, self._keys[seq], seq.params.priority
        need = blocks_needed(self.block_manager, hits, num_tokens)
        victims: list[Sequence] = []
        keep = set(hits)
        refs: dict[int, int] = {}  # block -> references the victims so far leave it
        # Strict on the priority itself (equal ones never displace each other) and behind
        # seq in the aged order (one that has aged past seq keeps its place).
        for other in reversed(self.running):
            if not full and need <= 0:
                break
            if other.params.priority > p and keys[other] > key:
                victims.append(other)
                full = False
                need -= blocks_released(self.block_manager, other, keep, refs)
        if full or need > 0:
            return False
        for victim in victims:
            self.preempt(victim, "priority")
        return True

    def _mark_waiting(self) -> None:
        """Why the waiting requests wait: the reason admission stopped (the head's; the rest
        queue behind it), except preempted ones, which say so until admitted again."""
        reason = self._blocked
        if reason == self._marked:
            return  # arrivals since took it in add(); admitted and preempted ones set theirs
        self._marked = reason
        for seq in self.waiting:
            if seq.wait_reason != "preempted":
                seq.wait_reason = reason

    # -- leaving ---------------------------------------------------------------------------
    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._turns.forget(seq)
        self._allowance.skip_running(seq)  # a turn it had in this step goes to the others
        counts, p = self._running_priorities, seq.params.priority
        counts[p] -= 1
        if not counts[p]:
            del counts[p]

    def preempt(self, seq: Sequence, reason: str = "memory") -> None:
        self._leave_running(seq)
        blocks = tuple(seq.block_table)
        self._thrown[seq] = seq.num_computed_tokens
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.wait_reason = "preempted"
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] += 1
        self.last_preemptions.append(Preemption(seq.request_id, reason, blocks,
                                                seq.params.priority))
        self.waiting.push_preempted(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of whichever queue holds it and give its blocks back."""
        if seq in self.running:
            self._leave_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self._order:  # live until now (not finished before)
            self._left(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.wait_reason = ""
        self._order.pop(seq, None)
        self._keys.pop(seq, None)
        self._thrown.pop(seq, None)
        self._turns.forget(seq)

    def _left(self, seq: Sequence) -> None:
        """seq is no longer live; when it was more urgent than work still live, hold the
        protected steps for priority_hold_s (the next turn of a chat comes soon)."""
        counts, p = self._live_priorities, seq.params.priority
        counts[p] -= 1
        if not counts[p]:
            del counts[p]
        if self.priority_hold_s > 0 and counts and p < max(counts):
            held, now = self._hold, self.clock()
            if held is None or p <= held[0] or now - held[1] >= self.priority_hold_s:
                self._hold = (p, now)

    def finish_for_capacity(self, seq: Sequence) -> None:
        """The pool cannot hold seq's next token even with nothing else running."""
        self.finish(seq, "length")
        self.finished_by_capacity.append(seq)


def scheduler_for(block_manager: BlockManager, config: EngineConfig,
                  previous: Scheduler | None) -> Scheduler:
    """The scheduler for a (re)built pool; `previous`, the one it replaces, hands over its
    cumulative counters."""
    sched = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                      policy=config.scheduling_policy, priority_aging_s=config.priority_aging_s,
                      max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
                      priority_lower_tokens=config.priority_lower_tokens,
                      priority_hold_s=config.priority_hold_s)
    if previous is not None:
        sched._hold = previous._hold  # a rebuilt pool does not end a chat's hold
        sched.num_preemptions = previous.num_preemptions
        sched.preemptions_by_reason = dict(previous.preemptions_by_reason)
        sched.recomputed_tokens = previous.recomputed_tokens
        sched.clock = previous.clock
    return sched
