"""A y axis for small plots: as many tick labels as fit their height, in a smaller font.

pyqtgraph's default axis labels every tick of two levels whatever the plot's height, so on a
plot 80 px tall the numbers run into each other."""
from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtGui import QFont, QFontMetrics

TICK_POINT_SIZE = 7
LABEL_GAP = 1.6  # a label's height times this: the least distance between two labels


def tick_font() -> QFont:
    font = QFont()
    font.setPointSize(TICK_POINT_SIZE)
    return font


def labels_that_fit(size_px: float, label_px: float) -> int:
    """How many labels, LABEL_GAP label heights apart, fit along size_px (at least 2)."""
    return max(2, int(size_px // (label_px * LABEL_GAP)) + 1)


def sparse_levels(levels: list, room: int) -> list:
    """The first (coarsest) tick level alone, thinned to at most `room` values."""
    if not levels:
        return levels
    for spacing, values in levels:
        if len(values) <= room:
            return [(spacing, values)]
    spacing, values = levels[0]
    step = math.ceil(len(values) / room)
    return [(spacing * step, list(values)[::step])]


class SparseAxis(pg.AxisItem):
    """Only the tick labels that fit the axis's length, one level, in a small font."""

    def __init__(self, orientation: str = "left", **kwargs) -> None:
        super().__init__(orientation, **kwargs)
        self.setStyle(tickFont=tick_font())
        self.label_px = QFontMetrics(tick_font()).height()

    def tickValues(self, minVal: float, maxVal: float, size: float) -> list:  # noqa: N802
        if size <= 0:  # not laid out yet: nothing to label
            return []
        return sparse_levels(super().tickValues(minVal, maxVal, size),
                             labels_that_fit(size, self.label_px))


def use_sparse_y_axis(plot: pg.PlotItem) -> SparseAxis:
    """Give a small plot a SparseAxis on the left, keeping its width and label."""
    old = plot.getAxis("left")
    axis = SparseAxis("left")
    label = old.labelText
    plot.setAxisItems({"left": axis})
    if label:
        axis.setLabel(label)
    return axis
