"""The settings of an engine the window cannot change, shown as they are, read-only, each with
the reason (vLLM and llama-server fix them when they start)."""
from __future__ import annotations

from PySide6.QtWidgets import QFormLayout, QGroupBox, QLabel, QLineEdit, QWidget


class ReadOnlySettings(QGroupBox):
    def __init__(self, kind: str, rows: list[tuple[str, str, str]], reason: str,
                 parent: QWidget | None = None) -> None:
        """rows: (key, title, why it is read-only)."""
        super().__init__(f"Engine settings (read-only: {kind})", parent)
        form = QFormLayout(self)
        self.fields: dict[str, QLineEdit] = {}
        for key, title, why in rows:
            field = QLineEdit("—")
            field.setReadOnly(True)
            field.setEnabled(False)
            field.setToolTip(why)
            label = QLabel(title)
            label.setToolTip(why)
            form.addRow(label, field)
            self.fields[key] = field
        self.note = QLabel(f"kvscope changes these live on its own engine; {reason}.")
        self.note.setWordWrap(True)
        self.note.setObjectName("readOnlyReason")
        form.addRow(self.note)

    def show_settings(self, settings: dict[str, str]) -> None:
        for key, field in self.fields.items():
            if key in settings:
                field.setText(settings[key])
                field.setCursorPosition(0)


class NotReported(QLabel):
    """A view's place for a source that lacks its data: says so, draws nothing."""

    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setWordWrap(True)
        self.setObjectName("notReported")
        self.setStyleSheet("color: #c8a050; padding: 12px;")
