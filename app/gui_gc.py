"""Python's cycle collector runs in whichever thread happens to allocate when a threshold is
crossed. If that is a worker thread (the state receiver, the vLLM scraper, a chat request) and
the garbage holds a Qt wrapper, its C++ object is destroyed off the GUI thread, which can crash
the process. So the window turns automatic collection off and collects on a timer in the GUI
thread instead (the remedy pyqtgraph's `GarbageCollector` describes)."""
from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 1000


class GuiThreadCollector(QObject):
    """While alive, cycles are collected only here, in the thread that created it."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = INTERVAL_MS) -> None:
        super().__init__(parent)
        self.was_enabled = gc.isenabled()
        gc.disable()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.collect_due)
        self.timer.start(interval_ms)

    def collect_due(self) -> None:
        """Collect the generations whose counts passed their thresholds, youngest first."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in range(3):
            if counts[generation] <= thresholds[generation]:
                break
            gc.collect(generation)

    def stop(self) -> None:
        self.timer.stop()
        gc.collect()
        if self.was_enabled:
            gc.enable()
