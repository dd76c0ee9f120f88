"""The history plots' time windows, shared by the batch plots and the device panel so one
choice means the same span everywhere."""
from __future__ import annotations

WINDOWS = {"Last 30 s": 30.0, "Last 5 min": 300.0, "All": None}


def x_range(end: float, window: str) -> tuple[float, float]:
    """The x range (seconds) that shows `window` up to `end`, at least a second wide."""
    span = WINDOWS.get(window)
    start = 0.0 if span is None else max(0.0, end - span)
    return start, max(end, start + 1.0)
