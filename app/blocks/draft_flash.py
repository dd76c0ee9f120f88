"""Blocks whose speculative draft slots were rolled back flash briefly on the map (issue 31):
a verify wrote K/V for drafted tokens, the model rejected some, and those slots (and any block
that held nothing else) went back. Same fade as a preemption's flash, in its own colour."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvscope.app.blocks.flash import Preempted, PreemptionFlash

DRAFT_RGB = (90, 200, 255)


class DraftFlash(PreemptionFlash):
    def observe(self, frame) -> bool:
        now = self.clock()
        began = False
        for b in getattr(frame, "rolled_back_blocks", ()) or ():
            if 0 <= b < frame.num_blocks:
                self._started[b] = now
                self._recent[b] = Preempted("", "draft", 0, now)
                began = True
        return began

    def _groups(self, now: float, size: int):
        items = [(b, now - t) for b, t in self._started.items() if b < size]
        if items:
            yield (DRAFT_RGB, np.array([b for b, _ in items], np.int64),
                   np.array([a for _, a in items], np.float64))


class Flashes:
    """A preemption flash with draft marks beside it, behind PreemptionFlash's interface
    (the map calls observe, active, blocks, paint and recent); preemptions paint last, so
    they win a block both marked."""

    def __init__(self, preemptions: PreemptionFlash, clock: Callable[[], float]) -> None:
        self.preemptions = preemptions
        self.drafts = DraftFlash(clock)

    @property
    def clock(self) -> Callable[[], float]:
        return self.preemptions.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:  # tests hold the time still
        self.preemptions.clock = self.drafts.clock = clock

    def observe(self, frame) -> bool:
        drafted = self.drafts.observe(frame)
        return self.preemptions.observe(frame) or drafted

    def active(self) -> bool:
        drafts = self.drafts.active()
        return self.preemptions.active() or drafts

    def blocks(self) -> list[int]:
        return sorted({*self.preemptions.blocks(), *self.drafts.blocks()})

    def paint(self, pixels: np.ndarray) -> None:
        self.drafts.paint(pixels)
        self.preemptions.paint(pixels)

    def recent(self, block: int) -> Preempted | None:
        return self.preemptions.recent(block)


def with_draft_marks(preemptions: PreemptionFlash, clock: Callable[[], float]) -> Flashes:
    return Flashes(preemptions, clock)
