"""A progress bar with an estimate of the time left, on stderr.

On a terminal the bar redraws in place; otherwise (a pipe: the window's QProcess, a log file)
it prints one line every few seconds, "[kv-accuracy] progress 42% eta 3m10s float32 2k",
which app/kv_grid/runner.py parses. Work is counted in tokens the model computes, known in
advance, so the estimate is elapsed * remaining / done.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

Clock = Callable[[], float]
WIDTH = 30


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    def __init__(self, total: float, name: str = "kv-accuracy", stream: TextIO | None = None,
                 clock: Clock = time.monotonic, every_s: float = 2.0) -> None:
        self.total = max(float(total), 1.0)
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.every_s = every_s
        self.start = clock()
        self.done = 0.0
        self.label = ""
        self._last = -1e9
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def eta(self) -> float | None:
        """Seconds left at the pace so far; None before anything is done."""
        if self.done <= 0:
            return None
        elapsed = self.clock() - self.start
        return elapsed * (self.total - self.done) / self.done

    def line(self) -> str:
        share = min(self.done / self.total, 1.0)
        eta = self.eta()
        left = "?" if eta is None else format_seconds(eta)
        if self._tty:
            bar = "#" * int(share * WIDTH)
            return f"[{self.name}] [{bar:<{WIDTH}}] {share:4.0%} eta {left} {self.label}"
        return f"[{self.name}] progress {share:.0%} eta {left} {self.label}"

    def advance(self, amount: float, label: str | None = None, force: bool = False) -> None:
        self.done = min(self.total, self.done + amount)
        if label is not None:
            self.label = label
        now = self.clock()
        if force or now - self._last >= self.every_s:
            self._last = now
            self._write()

    def _write(self) -> None:
        if self._tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def finish(self) -> None:
        self.done = self.total
        self._write()
        if self._tty:
            self.stream.write("\n")
        took = format_seconds(self.clock() - self.start)
        self.stream.write(f"[{self.name}] done in {took}\n")
        self.stream.flush()
