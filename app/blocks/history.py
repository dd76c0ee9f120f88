"""The window's memory of block tables, so finished requests and cached blocks can be explained.

What is exact and what is memory:
- The engine sends block tables only for live requests (BlocksFrame.tables). A finished
  request's table is what THIS WINDOW saw in the last blocks frame that still listed it: a
  block it took after that frame (its last step or two) is missing here, and a request that
  started and finished between two frames the window received is not known at all.
- Whether a remembered block still holds that request's KV is exact up to a 32-bit tag
  collision: the frame carries a content tag for every prefix-cached block (hash_tags), and
  the tag remembered with the table must still be on the same block id. An evicted block that
  was refilled carries another tag. A block that had no hash when last seen (a partial tail,
  or a private copy of content cached elsewhere) was freed when the request ended.
- Frames without tags (an engine from before protocol 3) only allow "hashed then and
  hashed now" on the same block id, which misses an eviction followed by a re-cache;
  `exact` says which of the two a result is.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvscope.ipc.messages import BLOCK_HAS_HASH, BLOCK_STATE_MASK, BLOCK_USED

FINISHED_KEPT = 512  # finished requests remembered, oldest dropped first

# What a finished request's block is now (BlockTableModel shows the names).
CACHED, REUSED, EVICTED, FREED = 1, 2, 3, 4
# A table entry of -1: the block was freed as a sliding window (every layer windowed) moved
# past it, while the request ran.
BEHIND_WINDOW = 5
NO_HASH, HASH_UNKNOWN = -1, -2  # remembered tags: not cacheable; hashed, frame had no tags


@dataclass
class Remembered:
    """A finished request's block table as last seen, with each block's content tag then."""
    request_id: str
    physical: np.ndarray  # block ids in logical order
    filled: np.ndarray  # tokens in each block then
    tags: np.ndarray  # content tag of each block then, NO_HASH or HASH_UNKNOWN
    num_tokens: int
    step: int  # engine step of the frame it was last seen in


@dataclass
class FinishedView:
    """A finished request's blocks against the current frame."""
    remembered: Remembered
    states: np.ndarray  # CACHED / REUSED / EVICTED / FREED per logical block
    exact: bool  # False: the frame has no content tags, see the module docstring

    def count(self, state: int) -> int:
        return int(np.count_nonzero(self.states == state))

    def resident(self) -> np.ndarray:
        """Block ids that still hold this request's KV."""
        keep = (self.states == CACHED) | (self.states == REUSED)
        return self.remembered.physical[keep]


@dataclass
class Holder:
    """A finished request whose remembered table has a given block with its current content."""
    request_id: str
    logical: int


class RequestHistory:
    """Feed it every blocks frame (observe); ask it about requests no longer in the frame."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = FINISHED_KEPT if limit is None else limit
        self.finished: OrderedDict[str, Remembered] = OrderedDict()
        self._last = None  # the previous frame: where departing requests' tables are

    def clear(self) -> None:
        self.finished.clear()
        self._last = None

    def observe(self, frame) -> None:
        """Remember the tables of requests that left since the previous frame."""
        last = self._last
        if last is not None and _other_pool(last, frame):
            self.finished.clear()  # block ids of another engine or pool mean nothing here
            last = None
        if last is not None:
            live = set(frame.request_ids)
            gone = [r for r in last.request_ids if r not in live]
            if gone:
                self._remember(last, gone)
        if self.finished:
            for rid in frame.request_ids:  # the same id sent again is live, not finished
                self.finished.pop(rid, None)
        self._last = frame

    def _remember(self, frame, request_ids: list[str]) -> None:
        tags = frame.block_tags()
        if not _has_tags(frame):
            tags[(frame.array("flags") & BLOCK_HAS_HASH) != 0] = HASH_UNKNOWN
        filled = frame.array("filled")
        offsets = frame.array("table_offsets")
        tables = frame.array("tables")
        index = {rid: i for i, rid in enumerate(frame.request_ids)}
        for rid in request_ids:
            i = index[rid]
            physical = tables[offsets[i]:offsets[i + 1]].astype(np.int32)
            gone = physical < 0
            at = np.where(gone, 0, physical)
            self.finished[rid] = Remembered(
                rid, physical, np.where(gone, 0, filled[at]).astype(np.int32),
                np.where(gone, NO_HASH, tags[at]), int(frame.num_tokens[i]), int(frame.step))
            self.finished.move_to_end(rid)
        while len(self.finished) > self.limit:
            self.finished.popitem(last=False)

    def finished_view(self, frame, request_id: str) -> FinishedView | None:
        """What the pool still holds of a finished request (None: not remembered)."""
        r = self.finished.get(request_id)
        if r is None:
            return None
        tagged = _has_tags(frame)
        gone = r.physical < 0
        at = np.where(gone, 0, r.physical)
        flags = frame.array("flags")[at]
        same = (r.tags != NO_HASH) & ((flags & BLOCK_HAS_HASH) != 0)
        if tagged:
            known = r.tags >= 0
            same &= ~known | (frame.block_tags()[at] == r.tags)
        exact = tagged and not bool(np.any(r.tags == HASH_UNKNOWN))
        in_use = (flags & BLOCK_STATE_MASK) == BLOCK_USED
        states = np.where(gone, BEHIND_WINDOW, np.where(
            r.tags == NO_HASH, FREED, np.where(same, np.where(in_use, REUSED, CACHED), EVICTED)))
        return FinishedView(r, states.astype(np.int8), exact)

    def holders(self, frame, block: int) -> list[Holder]:
        """Finished requests that had `block` with the content it holds now (newest first)."""
        if not 0 <= block < frame.num_blocks or not frame.array("flags")[block] & BLOCK_HAS_HASH:
            return []
        tag = int(frame.block_tags()[block]) if _has_tags(frame) else None
        found = []
        for r in reversed(self.finished.values()):
            where = np.flatnonzero(r.physical == block)
            then = r.tags[where[0]] if len(where) else NO_HASH
            if then != NO_HASH and (tag is None or then in (tag, HASH_UNKNOWN)):
                found.append(Holder(r.request_id, int(where[0])))
        return found


def _has_tags(frame) -> bool:
    hashed = int(np.count_nonzero(frame.array("flags") & BLOCK_HAS_HASH))
    return hashed == 0 or len(frame.hash_tags) == 4 * hashed


def _other_pool(last, frame) -> bool:
    """A restarted engine starts its counters again; a reconfigure changes the pool."""
    return (frame.num_blocks != last.num_blocks or frame.block_size != last.block_size
            or frame.seq < last.seq or frame.step < last.step)


def live_holders(frame, block: int) -> list[tuple[str, int]]:
    """Live requests whose block table has `block`, with its logical index (exact)."""
    tables = frame.array("tables")
    positions = np.flatnonzero(tables == block)
    if not len(positions):
        return []
    offsets = frame.array("table_offsets")
    owners = np.searchsorted(offsets, positions, side="right") - 1
    return [(frame.request_ids[int(i)], int(p - offsets[i]))
            for p, i in zip(positions, owners, strict=True)]
