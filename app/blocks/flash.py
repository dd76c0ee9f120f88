"""Preempted blocks flash on the map: a preemption's victim's blocks light up in the reason's
colour and fade back to what they are now over FLASH_S, so the eye catches where the KV went.

Pure numpy and a clock: the map calls observe() for every blocks frame and paint() on every
frame-clock tick (GUI thread) while something is flashing; active() tells it when to stop.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FLASH_S = 0.6
RECENT_S = 5.0  # the hover text remembers a preemption this long
REASON_RGB = {"memory": (255, 85, 85), "priority": (255, 190, 60)}
OTHER_RGB = (255, 120, 200)


@dataclass(frozen=True)
class Preempted:
    """What the hover says about a block a preemption freed."""
    request_id: str
    reason: str
    priority: int
    at: float  # clock time the window saw it


class PreemptionFlash:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._started: dict[int, float] = {}  # block -> when its flash began
        self._recent: dict[int, Preempted] = {}

    def observe(self, frame) -> bool:
        """Start a flash for each block of the frame's preemptions; True when any began."""
        now = self.clock()
        began = False
        for p in getattr(frame, "preemptions", ()) or ():
            info = Preempted(p.request_id, p.reason, p.priority, now)
            for b in p.block_ids:
                if 0 <= b < frame.num_blocks:  # -1: a window-freed table entry
                    self._started[b] = now
                    self._recent[b] = info
                    began = True
        return began

    def active(self) -> bool:
        """Whether a flash is still running (drops the finished ones)."""
        now = self.clock()
        self._started = {b: t for b, t in self._started.items() if now - t < FLASH_S}
        return bool(self._started)

    def blocks(self) -> list[int]:
        return sorted(self._started)

    def paint(self, pixels: np.ndarray) -> None:
        """Blend the flashing cells of a grid of 0xffRRGGBB words (block id = flat index) in
        place: full flash colour at the start, the cell's own colour at FLASH_S."""
        if not self._started:
            return
        now = self.clock()
        flat = pixels.reshape(-1)
        for rgb, blocks, ages in self._groups(now, len(flat)):
            a = np.clip(1.0 - ages / FLASH_S, 0.0, 1.0)
            base = flat[blocks]
            out = np.full(len(blocks), 0xFF << 24, np.uint32)
            for shift, value in zip((16, 8, 0), rgb, strict=True):
                channel = (base >> shift) & 0xFF
                mixed = np.rint(channel * (1 - a) + value * a).astype(np.uint32)
                out |= mixed << shift
            flat[blocks] = out

    def _groups(self, now: float, size: int):
        by_rgb: dict[tuple[int, int, int], list[tuple[int, float]]] = {}
        for b, t in self._started.items():
            if b < size:
                reason = self._recent[b].reason
                by_rgb.setdefault(REASON_RGB.get(reason, OTHER_RGB), []).append((b, now - t))
        for rgb, items in by_rgb.items():
            blocks = np.array([b for b, _ in items], np.int64)
            ages = np.array([age for _, age in items], np.float64)
            yield rgb, blocks, ages

    def recent(self, block: int) -> Preempted | None:
        """The last preemption that freed this block, if the window saw it lately."""
        info = self._recent.get(block)
        if info is None or self.clock() - info.at > RECENT_S:
            return None
        return info

    def clear(self) -> None:
        self._started.clear()
        self._recent.clear()
