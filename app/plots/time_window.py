"""The history plots' time windows, shared by the batch plots and the device panel so one
choice means the same span everywhere, and the stepped ranges that keep their axes still.

An axis repaints (tick layout, labels, a QPicture replay) whenever its range moves; a window
that scrolled with every new point repainted every axis of every plot at the frame rate.
Ranges here move in steps: the x range jumps forward by a tenth of the window when the newest
point reaches its right edge, the y range only when the data outgrows a 1-2-5 ceiling."""
from __future__ import annotations

import math

WINDOWS = {"Last 30 s": 30.0, "Last 5 min": 300.0, "All": None}
X_STEPS = 10  # a window's right edge moves in tenths of its span


def nice_ceiling(x: float) -> float:
    """The smallest 1, 2, 2.5 or 5 x 10^k at or above x (x > 0); 1 for anything else."""
    if not x > 0 or not math.isfinite(x):
        return 1.0
    scale = 10.0 ** math.floor(math.log10(x))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * scale >= x * (1 - 1e-12):
            return m * scale
    return 10.0 * scale


def x_range(end: float, window: str) -> tuple[float, float]:
    """The x range (seconds) that shows `window` up to `end`, at least a second wide; its
    right edge is `end` rounded up to a step, so it stays put between steps."""
    span = WINDOWS.get(window)
    if span is None:  # "All": from 0 to a 1-2-5 ceiling of the end
        return 0.0, nice_ceiling(max(end, 1.0))
    step = span / X_STEPS
    right = max(span, math.ceil(end / step) * step)
    return max(0.0, right - span), right
