"""The status bar of a watched engine: which engine is shown, alive / DEAD with the reason,
and its stream's counts (received, shown, coalesced, lost, bad payloads)."""
from __future__ import annotations

from PySide6.QtWidgets import QLabel, QStatusBar, QWidget


class SourceStatusBar(QStatusBar):
    def __init__(self, label: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = "connecting"
        self.dead_reason = ""
        self.last_bad = ""
        self.engine_label = QLabel(label)
        self.engine_label.setObjectName("engineName")
        self.state_label = QLabel("● connecting…")
        self.counts_label = QLabel("")
        self.addWidget(self.engine_label)
        self.addWidget(self.state_label)
        self.addPermanentWidget(self.counts_label)

    def mark_alive(self) -> None:
        self.state, self.dead_reason = "alive", ""
        self.state_label.setText("● alive")
        self.state_label.setStyleSheet("color: #6fcf73;")

    def mark_dead(self, reason: str) -> None:
        self.state, self.dead_reason = "dead", reason
        self.state_label.setText(f"● DEAD: {reason}")
        self.state_label.setToolTip(reason)
        self.state_label.setStyleSheet("color: #ef6a6a;")

    def show_bad(self, what: str) -> None:
        self.last_bad = what

    def show_stream(self, counts, hz: float | None = None) -> None:
        text = (f"updates {counts.received} · shown {counts.shown} · coalesced "
                f"{counts.coalesced} · lost {counts.lost} · bad {counts.bad}")
        if counts.bad and self.last_bad:
            text += f" (last: {self.last_bad[:80]})"
        if text != self.counts_label.text():
            self.counts_label.setText(text)
            self.counts_label.setToolTip(self.last_bad)
