"""The window's one repaint clock: what repaints on which tick, and how fast it ticks.

Every tick repaints the fast views (the block map image, the memory bar); the history plots
and the text labels repaint on every PLOTS_EVERY-th and LABELS_EVERY-th tick, on different
ticks, so no single frame pays for all of them. While the engine is busy the clock ticks
slower (BUSY_MS): on a small machine the window and the engine share the same cores, and
every millisecond the window paints is one the engine does not compute.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer

IDLE_MS = 33  # ~30 Hz while the engine idles: the map follows the mouse and a new request
BUSY_MS = 100  # ~10 Hz while it computes: the map still moves, the engine keeps its cores
PLOTS_EVERY = 6  # history plots at 5 Hz idle, ~1.7 Hz busy
LABELS_EVERY = 6  # text at the same rate, three ticks later


@dataclass
class FrameJobs:
    """What one tick may run: each list in order, each job a no-op when nothing changed."""
    every_tick: list[Callable[[], None]] = field(default_factory=list)
    plots: list[Callable[[], None]] = field(default_factory=list)
    labels: list[Callable[[], None]] = field(default_factory=list)


class FrameClock(QObject):
    def __init__(self, jobs: FrameJobs, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.jobs = jobs
        self.ticks = 0
        self.busy = False
        self.timer = QTimer(self)
        self.timer.setInterval(IDLE_MS)
        self.timer.timeout.connect(self.tick)

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def set_busy(self, busy: bool) -> None:
        """Tick at BUSY_MS while the engine computes, IDLE_MS otherwise."""
        if busy != self.busy:
            self.busy = busy
            self.timer.setInterval(BUSY_MS if busy else IDLE_MS)

    @property
    def interval_ms(self) -> int:
        return self.timer.interval()

    @property
    def hz(self) -> float:
        return 1000.0 / self.timer.interval()

    def tick(self) -> None:
        """One frame: the fast views, plus the plots or the labels when it is their turn."""
        n = self.ticks
        self.ticks += 1
        due = list(self.jobs.every_tick)
        if n % PLOTS_EVERY == 0:
            due += self.jobs.plots
        if n % LABELS_EVERY == LABELS_EVERY // 2:
            due += self.jobs.labels
        for job in due:
            job()
