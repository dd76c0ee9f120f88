"""Keep the Trace tab's labels from widening it: file names get break points, and a wrapped
label takes the width its dock gives instead of the width of its longest word."""
from __future__ import annotations

from PySide6.QtWidgets import QLabel, QSizePolicy

ZWSP = "\u200b"  # a zero-width space: Qt may wrap a line there, and draws nothing
BREAK_AFTER = "-_./"


def breakable(name: str) -> str:
    """The name with a wrap point after each - _ . / (a file name has no spaces to wrap at)."""
    return "".join(c + ZWSP if c in BREAK_AFTER else c for c in name)


def shown_name(text: str) -> str:
    """A label's text as the user would copy it: without the break points."""
    return text.replace(ZWSP, "")


def never_widen(label: QLabel) -> QLabel:
    """A word-wrapped label whose minimum width is not its longest word's."""
    label.setWordWrap(True)
    policy = label.sizePolicy()  # keeps the height-for-width that word wrap turned on
    policy.setHorizontalPolicy(QSizePolicy.Policy.Ignored)
    label.setSizePolicy(policy)
    label.setMinimumWidth(0)
    return label
