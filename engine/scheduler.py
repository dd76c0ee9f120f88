"""Continuous batching: re-form the batch every step under a token budget and a sequence cap.

Running requests go first (a decode is one token; a request still prefilling gets the next
chunk), then waiting requests are admitted in arrival order with prefill chunks from what is
left of the budget. When the pool runs dry the most recently admitted running request is
preempted by recompute: its blocks are freed and it goes back to the head of the queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvscope.engine.block_manager import BlockManager
from kvscope.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int

    @property
    def is_decode(self) -> bool:
        """One new token after an already generated one (anything else is prefill work)."""
        return self.num_tokens == 1 and self.seq.num_output_tokens > 0 \
            and self.seq.num_computed_tokens == self.seq.num_tokens - 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Requests finished by the scheduler itself (no room even alone); the engine reports them.
        self.finished_by_capacity: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        preemptions_before = self.num_preemptions
        scheduled: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        bs, caching = bm.block_size, bm.enable_prefix_caching
        running = SequenceStatus.RUNNING
        # Runs once per running sequence per step, so the block arithmetic is inline and the
        # block manager is called only when the chunk needs a block or completes one (for a
        # decode: once every block_size steps).
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted a moment ago to make room for an earlier request
            start = seq.num_computed_tokens
            num_tokens = min(len(seq.token_ids) - start, budget)
            end = start + num_tokens
            need = -(-end // bs) - len(seq.block_table)  # = bm.num_new_blocks when > 0
            if need > 0:
                if not self._make_room(seq, need):
                    continue
                bm.append_blocks(seq, need)
            if caching and end // bs > start // bs:
                bm.commit_full_blocks(seq, start, end)
            scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        # Admitting new work right after a preemption would only thrash the pool.
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(scheduled, budget)
        return scheduled

    def _make_room(self, seq: Sequence, need: int) -> bool:
        """Preempt later arrivals until seq's `need` new blocks are free; False if seq itself
        had to go."""
        while need > self.block_manager.num_free_blocks:
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self.finish_for_capacity(seq)
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            num_tokens = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(seq, hits, num_tokens):
                if not self.running and self.block_manager.num_used_blocks == 0:
                    self.waiting.popleft()
                    self.finish_for_capacity(seq)
                    continue
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, hits, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._commit(seq, num_tokens)
            scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens

    def _commit(self, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        self.block_manager.commit_full_blocks(seq, start, start + num_tokens)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of whichever queue holds it and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def finish_for_capacity(self, seq: Sequence) -> None:
        """The pool cannot hold seq's next token even with nothing else running."""
        self.finish(seq, "length")
        self.finished_by_capacity.append(seq)
