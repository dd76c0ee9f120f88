"""The history plots' time windows, shared by the batch plots and the device panel so one
choice means the same span everywhere, and the stepped ranges that keep their axes still.

An axis repaints (tick layout, labels, a QPicture replay) whenever its range moves; a window
that scrolled with every new point repainted every axis of every plot at the frame rate.
Ranges here move in steps: the x range jumps forward by a tenth of the window when the newest
point reaches its right edge, the y range only when the data outgrows a ceiling from NICE."""
from __future__ import annotations

import math

WINDOWS = {"Last 30 s": 30.0, "Last 5 min": 300.0, "All": None}
X_STEPS = 10  # a window's right edge moves in tenths of its span


NICE = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def nice_ceiling(x: float) -> float:
    """The smallest NICE x 10^k at or above x (x > 0); 1 for anything else. Close enough
    steps that the data fills most of the height, few enough that the axis rarely moves."""
    if not x > 0 or not math.isfinite(x):
        return 1.0
    scale = 10.0 ** math.floor(math.log10(x))
    for m in NICE:
        if m * scale >= x * (1 - 1e-12):
            return m * scale
    return 10.0 * scale


def x_range(end: float, window: str) -> tuple[float, float]:
    """The x range (seconds) that shows `window` up to `end`, at least a second wide; its
    right edge is `end` rounded up to a step, so it stays put between steps."""
    span = WINDOWS.get(window)
    if span is None:  # "All": from 0 to a nice ceiling of the end
        return 0.0, nice_ceiling(max(end, 1.0))
    step = span / X_STEPS
    right = max(span, math.ceil(end / step) * step)
    return max(0.0, right - span), right
