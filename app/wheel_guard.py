"""Numeric fields ignore the mouse wheel unless they have focus, so the wheel scrolls the panel.

Qt's spin boxes, combo boxes and sliders take the wheel whenever the pointer is over them: a
user scrolling a long side panel silently changed the KV calculator's headroom from 5 % to
0 %. The common idiom, applied here to a whole panel at once: such fields take focus only by
click or tab (Qt.StrongFocus, never by the wheel), and an event filter hands a wheel event to
the enclosing scroll area unless the field already has focus. (Handed on explicitly: Qt
propagates only a spontaneous wheel event to the parents, and a field inside a widget that
is not a scroll area must not take it either.)
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QAbstractSlider,
    QAbstractSpinBox,
    QApplication,
    QComboBox,
    QScrollBar,
    QWidget,
)

WHEEL_FIELDS = (QAbstractSpinBox, QComboBox, QAbstractSlider)


class WheelGuard(QObject):
    """The event filter: a wheel over an unfocused field goes to its parent instead."""

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if (event.type() == QEvent.Type.Wheel and isinstance(watched, QWidget)
                and not watched.hasFocus()):
            area = scroll_area_of(watched)
            if area is not None:
                QApplication.sendEvent(area.viewport(), event)
            return True  # the field never sees it
        return False


def scroll_area_of(widget: QWidget) -> QAbstractScrollArea | None:
    """The nearest scroll area that holds the widget (None: none does)."""
    parent = widget.parentWidget()
    while parent is not None and not isinstance(parent, QAbstractScrollArea):
        parent = parent.parentWidget()
    return parent


def guard_wheel(root: QWidget) -> WheelGuard:
    """Guard every numeric field under `root` (the guard lives as long as `root`)."""
    guard = WheelGuard(root)
    for cls in WHEEL_FIELDS:
        for field in root.findChildren(cls):
            if isinstance(field, QScrollBar):
                continue  # a scroll bar is what the wheel should move
            field.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            field.installEventFilter(guard)
    return guard
