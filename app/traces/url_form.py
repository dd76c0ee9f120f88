"""Where to replay a trace against an OpenAI-compatible server: its URL, an API key (never on
a command line: the replay gets it in its environment), the served model (empty: the first
the server lists), the speed and how many requests may be in flight."""
from __future__ import annotations

from PySide6.QtWidgets import QComboBox, QFormLayout, QLineEdit, QSpinBox, QWidget

SPEEDS = ["1", "2", "5", "10", "max"]
API_KEY_ENV = "OPENAI_API_KEY"  # what `kvscope trace replay --api-key` defaults to


class ReplayUrlForm(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.url_edit = QLineEdit("http://127.0.0.1:8000/v1")
        self.url_edit.setObjectName("traceReplayUrl")
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("none")
        self.model_edit = QLineEdit()
        self.model_edit.setPlaceholderText("the first the server lists")
        self.speed = QComboBox()
        self.speed.addItems(SPEEDS)
        self.speed.setToolTip("the recorded arrival times, sped up; max: as fast as the "
                              "concurrency allows")
        self.concurrency = QSpinBox()
        self.concurrency.setRange(1, 1024)
        self.concurrency.setValue(16)
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("URL", self.url_edit)
        form.addRow("API key", self.key_edit)
        form.addRow("model", self.model_edit)
        form.addRow("speed", self.speed)
        form.addRow("in flight", self.concurrency)

    def replay_args(self) -> list[str]:
        """`trace replay` options after TRACE (the key is not among them: see api_key)."""
        args = ["--url", self.url_edit.text().strip(), "--speed", self.speed.currentText(),
                "--max-concurrency", str(self.concurrency.value())]
        if self.model_edit.text().strip():
            args += ["--model", self.model_edit.text().strip()]
        return args

    def api_key(self) -> str:
        return self.key_edit.text().strip()

    def set_enabled(self, enabled: bool) -> None:
        for w in (self.url_edit, self.key_edit, self.model_edit, self.speed, self.concurrency):
            w.setEnabled(enabled)
