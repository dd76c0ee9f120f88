"""The window's one repaint clock: what repaints on which tick, and how fast it ticks.

Every tick repaints the fast views (the block map image, the memory bar); the history plots
and the text labels repaint on every PLOTS_EVERY-th and LABELS_EVERY-th tick, on different
ticks, so no single frame pays for all of them. While the engine is busy the clock ticks
slower: on a small machine the window and the engine share the same cores, and every
millisecond the window spends is one the engine does not compute. It starts at BUSY_MS and
then paces itself: once a second it reads how much CPU the whole window process used (Qt,
the socket thread, everything) and stretches the interval, up to MAX_BUSY_MS, until that
stays under BUSY_CPU_SHARE of one core.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, Signal

IDLE_MS = 33  # ~30 Hz while the engine idles: the map follows the mouse and a new request
BUSY_MS = 100  # ~10 Hz while it computes: the map still moves, the engine keeps its cores
MAX_BUSY_MS = 500  # never slower than 2 Hz: a live view, not a slideshow
BUSY_CPU_SHARE = 0.025  # of one core, the whole window process, while the engine computes
PACE_WINDOW_S = 1.0  # how often the busy clock re-reads its CPU share
PLOTS_EVERY = 6  # history plots at 5 Hz idle, ~1.7 Hz busy
LABELS_EVERY = 6  # text at the same rate, three ticks later


@dataclass
class FrameJobs:
    """What one tick may run: each list in order, each job a no-op when nothing changed."""
    every_tick: list[Callable[[], None]] = field(default_factory=list)
    plots: list[Callable[[], None]] = field(default_factory=list)
    labels: list[Callable[[], None]] = field(default_factory=list)


class FrameClock(QObject):
    intervalChanged = Signal(int)  # ms

    def __init__(self, jobs: FrameJobs, parent: QObject | None = None, *,
                 cpu_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(parent)
        self.jobs = jobs
        self.ticks = 0
        self.busy = False
        self.cpu_share: float | None = None  # the process's, over the last pacing window
        self.cpu_clock, self.wall_clock = cpu_clock, wall_clock
        self._mark: tuple[float, float] | None = None  # (wall, cpu) at the window's start
        self.timer = QTimer(self)
        self.timer.setInterval(IDLE_MS)
        self.timer.timeout.connect(self.tick)

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def set_busy(self, busy: bool) -> None:
        """Tick at BUSY_MS (then paced) while the engine computes, IDLE_MS otherwise."""
        if busy != self.busy:
            self.busy = busy
            self._mark = None
            self._set_interval(BUSY_MS if busy else IDLE_MS)

    def _set_interval(self, ms: int) -> None:
        if ms != self.timer.interval():
            self.timer.setInterval(ms)
            self.intervalChanged.emit(ms)

    def _pace(self) -> None:
        """Stretch the busy interval while the process uses more than its CPU share; shrink
        it back (not below BUSY_MS) while it uses less than half of it."""
        now, cpu = self.wall_clock(), self.cpu_clock()
        if self._mark is None:
            self._mark = (now, cpu)
            return
        wall0, cpu0 = self._mark
        if now - wall0 < PACE_WINDOW_S:
            return
        self._mark = (now, cpu)
        self.cpu_share = share = (cpu - cpu0) / (now - wall0)
        interval = self.timer.interval()
        if share > BUSY_CPU_SHARE:
            interval = min(MAX_BUSY_MS, round(interval * min(2.0, share / BUSY_CPU_SHARE)))
        elif share < BUSY_CPU_SHARE / 2:
            interval = max(BUSY_MS, round(interval * 0.8))
        self._set_interval(interval)

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
        if self.busy:
            self._pace()
