"""A plot title that wraps instead of setting the plot's least width.

pyqtgraph's title (a LabelItem) makes its text's full width the plot's minimum width, so in a
small window two plots side by side with legend titles ("requests ━ running ━ waiting ━
preempted") need more room than the grid has and the right column is cut off. This title asks
for no width: past its text's width it wraps onto a second line, which the title row (30 px,
PlotItem.setTitle) holds at the 8 pt the plots use.
"""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QSizeF, Qt


class WrappingTitle(pg.LabelItem):
    def natural_width(self) -> float:
        """The text's width on one line."""
        doc = self.item.document()
        saved = doc.textWidth()
        doc.setTextWidth(-1)
        width = doc.idealWidth()
        doc.setTextWidth(saved)
        return float(width)

    def resizeEvent(self, ev) -> None:
        width = self.size().width()
        # Wrap only when the line does not fit: a set text width left-aligns the text.
        self.item.setTextWidth(width if 0 < width < self.natural_width() else -1)
        super().resizeEvent(ev)

    def updateMin(self) -> None:
        bounds = self.itemRect()
        self.setMinimumWidth(0)
        self.setMinimumHeight(bounds.height())
        self._sizeHint = {
            Qt.SizeHint.MinimumSize: (0, bounds.height()),
            Qt.SizeHint.PreferredSize: (self.natural_width(), bounds.height()),
            Qt.SizeHint.MaximumSize: (-1, -1),
            Qt.SizeHint.MinimumDescent: (0, 0),
        }
        self.updateGeometry()

    def sizeHint(self, hint, constraint) -> QSizeF:
        if hint not in self._sizeHint:
            return QSizeF(0, 0)
        return QSizeF(*self._sizeHint[hint])


def use_wrapping_title(plot: pg.PlotItem) -> None:
    """Swap the plot's title for a WrappingTitle in the same layout cell (before setTitle)."""
    old = plot.titleLabel
    plot.layout.removeItem(old)
    if old.scene() is not None:
        old.scene().removeItem(old)
    plot.titleLabel = WrappingTitle("", size="11pt", parent=plot)
    plot.layout.addItem(plot.titleLabel, 0, 1)
