"""The scheduler's waiting requests, head first, in the order the policy admits them.

fcfs: arrival order, with preempted requests put back at the head (they arrived before
everything still waiting). priority: sorted by the scheduler's key, (priority, arrival) or its
aged form, so a preempted request simply goes back to its place.

A plain list: the queue is read head first and from end to end (snapshots, the trace), and
inserting into a few hundred pointers costs less than a heap's lazy deletion on abort.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from kvscope.engine.sequence import Sequence

SortKey = Callable[[Sequence], tuple[float, ...]]


class WaitingQueue:
    def __init__(self, key: SortKey | None = None) -> None:
        self._items: list[Sequence] = []
        self._key = key  # None: fcfs

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def __contains__(self, seq: object) -> bool:
        return any(s is seq for s in self._items)

    def __getitem__(self, i: int) -> Sequence:
        return self._items[i]

    def head(self) -> Sequence:
        return self._items[0]

    def pop_head(self) -> Sequence:
        return self._items.pop(0)

    def push(self, seq: Sequence) -> None:
        """A new arrival (or one re-queued by a reconfigure)."""
        if self._key is None:
            self._items.append(seq)
        else:
            bisect.insort_right(self._items, seq, key=self._key)

    def push_preempted(self, seq: Sequence) -> None:
        if self._key is None:
            self._items.insert(0, seq)
        else:
            bisect.insort_right(self._items, seq, key=self._key)

    def remove(self, seq: Sequence) -> None:
        for i, s in enumerate(self._items):
            if s is seq:
                del self._items[i]
                return
        raise ValueError(f"{seq.request_id} is not waiting")

    def reorder(self, key: SortKey | None) -> None:
        """Switch policy: sort by the new key; to fcfs, the order in force stays."""
        self._key = key
        if key is not None:
            self._items.sort(key=key)
