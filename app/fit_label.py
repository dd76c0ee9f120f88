"""Word-wrapped labels of a fixed size that never cut a line: when a text needs more lines
than the label has, the label grows (once, to fit) and keeps that height.

A label whose size follows its text re-lays out the whole window on every setText (1.5-4 ms
each, app.blocks.block_map); a fixed size stops that, but clips a longer text mid-line. Growing
only when a text needs it, and never shrinking back, costs a re-layout a handful of times a
session instead of on every refresh."""
from __future__ import annotations

from PySide6.QtWidgets import QLabel


def grow_to_fit(label: QLabel) -> bool:
    """Make a fixed-height, word-wrapped label tall enough for its text; True if it grew."""
    margins = label.contentsMargins()
    width = label.width() - margins.left() - margins.right()
    need = label.heightForWidth(label.width()) if width > 0 else -1
    if need <= label.height():
        return False
    label.setFixedHeight(need)
    return True
