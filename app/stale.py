"""How the window marks what a dead engine left on screen: its last numbers stay (they are
what the user was looking at when it died), greyed and said to be old, until a new engine's
first frame replaces them. One look and one wording for every view."""
from __future__ import annotations

import html

from PySide6.QtWidgets import QLabel

NOTE = "(engine stopped)"
GREY = "#6b7080"  # the style sheet's QLabel[stale="true"] colour: one grey everywhere


def mark(label: QLabel, stale: bool) -> None:
    """Grey a plain label's text (style sheet property "stale"), or un-grey it."""
    if bool(label.property("stale")) == stale:
        return  # a re-polish per refresh adds up
    label.setProperty("stale", stale)
    label.style().unpolish(label)
    label.style().polish(label)


def plain(text: str) -> str:
    """A plain label's text as a dead engine left it: the note first, where it is seen."""
    return f"{NOTE} {text}" if text and not text.startswith(NOTE) else text


def live(text: str) -> str:
    """plain()'s text back as a live engine's."""
    return text.removeprefix(f"{NOTE} ")


def rich(text: str, reason: str = "") -> str:
    """Rich text as a dead engine left it: a first line that says so, the rest greyed."""
    why = f": {html.escape(reason)}" if reason else ""
    return (f"<span style='color:{GREY}'><b>{NOTE}</b> last state, not updating{why}"
            f"<br>{text}</span>")
