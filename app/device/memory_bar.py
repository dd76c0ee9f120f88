"""The device's memory as one stacked horizontal bar, with a legend under it.

The bar paints the segments of app.device.memory_math (weights | KV used | KV free | KV cached |
other | free) over the device's total; hovering a segment names it with its bytes and share.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QRect, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QGridLayout, QLabel, QSizePolicy, QToolTip, QWidget

from kvscope.app.device.memory_math import COLORS, NAMES, Segment, bar_edges
from kvscope.app.fmt import human_bytes

BAR_HEIGHT = 22
BACKGROUND = QColor("#16181d")  # bytes no meter accounted for stay this colour
BORDER = QColor("#3e4451")
EMPTY_TEXT = QColor("#9aa0aa")


class MemoryBar(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.segments: list[Segment] = []
        self.total = 0
        self.details: dict[str, str] = {}  # segment name -> more lines for its tooltip
        self.setMouseTracking(True)
        self.setFixedHeight(BAR_HEIGHT)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(120)

    def set_segments(self, segments: list[Segment], total: int) -> None:
        self.segments, self.total = segments, total
        self.update()

    def clear(self) -> None:
        self.set_segments([], 0)

    # -- geometry -----------------------------------------------------------------------------
    def _inner(self) -> QRect:
        return self.rect().adjusted(1, 1, -1, -1)  # inside the 1 px border

    def edges(self) -> list[tuple[int, int]]:
        """Widget x [start, end) of each segment."""
        inner = self._inner()
        return [(inner.left() + a, inner.left() + b)
                for a, b in bar_edges(self.segments, self.total, inner.width())]

    def segment_at(self, x: int) -> Segment | None:
        for seg, (a, b) in zip(self.segments, self.edges(), strict=True):
            if a <= x < b:
                return seg
        return None

    def describe(self, seg: Segment) -> str:
        share = 100.0 * seg.bytes / self.total if self.total else 0.0
        text = f"{seg.name}: {human_bytes(seg.bytes)} ({share:.1f} % of {human_bytes(self.total)})"
        more = self.details.get(seg.name)
        return f"{text}\n{more}" if more else text

    # -- Qt -----------------------------------------------------------------------------------
    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        inner = self._inner()
        p.fillRect(self.rect(), BACKGROUND)
        for seg, (a, b) in zip(self.segments, self.edges(), strict=True):
            if b > a:
                p.fillRect(QRect(a, inner.top(), b - a, inner.height()), QColor(seg.colour))
        if not self.segments:
            p.setPen(EMPTY_TEXT)
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no device data yet")
        p.setPen(QPen(BORDER, 1))
        p.drawRect(self.rect().adjusted(0, 0, -1, -1))
        p.end()

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            seg = self.segment_at(int(event.pos().x()))
            if seg is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.describe(seg), self)
            return True
        return super().event(event)


class MemoryLegend(QWidget):
    """One entry per segment: colour swatch and name, then its bytes (right-aligned). Two
    columns to keep the panel short, filled top to bottom: the KV pool's parts on the left."""

    ROWS = 4

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.labels: dict[str, QLabel] = {}  # name -> its bytes
        self.names: dict[str, QLabel] = {}  # name -> its swatch and name
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(3)
        grid.setVerticalSpacing(0)
        for i, name in enumerate(NAMES):
            col, row = divmod(i, self.ROWS)
            swatch = QLabel(f"<span style='color:{COLORS[name]}'>■</span> {name}")
            swatch.setObjectName("memoryLegend")
            size = QLabel()
            size.setObjectName("memoryLegendBytes")
            size.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            grid.addWidget(swatch, row, 3 * col)
            grid.addWidget(size, row, 3 * col + 1)
            self.labels[name], self.names[name] = size, swatch
        grid.setColumnMinimumWidth(2, 8)  # a gap between the two entries of a row
        grid.setColumnStretch(2, 1)
        self.show_segments([])

    def set_details(self, details: dict[str, str]) -> None:
        """More about an entry (the GPU's other processes) as its tooltip."""
        for name in self.labels:
            tip = details.get(name, "")
            for label in (self.labels[name], self.names[name]):
                if label.toolTip() != tip:
                    label.setToolTip(tip)

    def show_segments(self, segments: list[Segment]) -> None:
        sizes = {s.name: s.bytes for s in segments}
        for name, label in self.labels.items():
            text = human_bytes(sizes.get(name))
            if label.text() != text:
                label.setText(text)
