"""A one-line label that elides its text at the right instead of asking for more width: a
long message (an engine's death reason, a long path) must never widen the window."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

MIN_CHARS = 12  # how much it shows at the least, in average character widths


class ElidedLabel(QLabel):
    """Shows as much of its text as fits, then "…"; the whole text is in the tooltip."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setToolTip(text)

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(text)

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), self.fontMetrics().averageCharWidth() * MIN_CHARS),
                     hint.height())

    def elided_text(self) -> str:
        """The text as it is drawn at the label's current width."""
        rect = self.contentsRect()
        return self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight,
                                             rect.width())

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(self.contentsRect(), int(self.alignment()), self.elided_text())
