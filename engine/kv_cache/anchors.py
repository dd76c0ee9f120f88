"""Anchor tokens: the first few positions of a sequence kept exact beside a 1-byte KV pool.

Why: in chat models the first token (and the few after it) is an attention sink. Most query
heads put a large share of their weight on it, so a quantization error in its K moves that
share and an error in its V reaches the output almost undamped, where the errors of the many
other tokens average out. Measured on the embedded model (docs/kv-dtypes.md): keeping the
first 4 positions exact cuts int8 KV's mean KL against float32 KV by about 40 %. This is the
idea of IntactKV (Liu et al., 2024) and of KVQuant's attention-sink handling.

Memory per token does not change. K/V at positions 0..n-1 depend only on tokens 0..n-1, so the
exact rows are kept once per distinct opening (the first n token ids) in a small table of
ENTRIES entries beside the pool, not per sequence: every chat that opens with the same system
prompt shares one entry. An entry is filled by the step that computes those positions and is
looked up by its tokens on every step, so a sequence whose opening is not in the table (table
full, or a prefix-cache hit on an opening whose entry was evicted) simply attends to the
quantized rows, as without anchors. Entries used in the current step are never evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ENTRIES = 32


@dataclass
class StepAnchors:
    """One step's anchors: entry index per sequence of the batch (-1: none), and the rows of
    the flattened batch whose exact K/V fill which anchor rows (entry * n + position)."""
    index: list[int]
    fill_rows: list[int]
    fill_slots: list[int]


class AnchorTable:
    """Which opening (first `num_tokens` token ids) holds which entry, least recently used
    first."""

    def __init__(self, num_tokens: int, num_entries: int = ENTRIES) -> None:
        if num_tokens < 1 or num_entries < 1:
            raise ValueError(f"an anchor table needs tokens >= 1 and entries >= 1, not "
                             f"{num_tokens} and {num_entries}")
        self.num_tokens = num_tokens
        self.num_entries = num_entries
        self.entries: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._free = list(range(num_entries - 1, -1, -1))
        self._step = 0
        self._used_in: dict[int, int] = {}  # entry -> last step that used it
        # Openings claimed by the last plan whose step has not run yet: if it never runs (an
        # error in the forward), their rows were never written and they are dropped.
        self._pending: list[tuple[int, ...]] = []

    def plan_step(self, openings: list[tuple[tuple[int, ...] | None, int, int, int]]
                  ) -> StepAnchors:
        """openings: per sequence (its first num_tokens token ids or None if it has fewer,
        first position computed this step, end position, its first row in the batch)."""
        self._step += 1
        for pending in self._pending:
            self._free.append(self.entries.pop(pending))
        self._pending = []
        index: list[int] = []
        fill_rows: list[int] = []
        fill_slots: list[int] = []
        n = self.num_tokens
        # A step's sequences mostly share a few openings: look each up once.
        seen: dict[tuple[int, ...] | None, int] = {}
        for key, start, end, row in openings:
            entry = seen.get(key)
            if entry is None or entry < 0:
                entry = seen[key] = self._lookup(key)
            if entry < 0 and key is not None and start == 0 and end >= n:
                entry = self._claim(key)
                if entry >= 0:
                    seen[key] = entry
                    fill_rows.extend(range(row, row + n))
                    fill_slots.extend(range(entry * n, entry * n + n))
            index.append(entry)
        return StepAnchors(index, fill_rows, fill_slots)

    def commit(self) -> None:
        """The planned step ran: its claimed entries hold their openings' rows."""
        self._pending = []

    def _lookup(self, key: tuple[int, ...] | None) -> int:
        entry = self.entries.get(key) if key is not None else None
        if key is None or entry is None:
            return -1
        self.entries.move_to_end(key)
        self._used_in[entry] = self._step
        return entry

    def _claim(self, key: tuple[int, ...]) -> int:
        """A free entry, or the least recently used one not used in this step; -1 if none."""
        if self._free:
            entry = self._free.pop()
        else:
            victim = next((k for k, e in self.entries.items()
                           if self._used_in.get(e) != self._step), None)
            if victim is None:
                return -1
            entry = self.entries.pop(victim)
        self.entries[key] = entry
        self._used_in[entry] = self._step
        self._pending.append(key)
        return entry
