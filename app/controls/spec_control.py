"""The Engine tab's speculative-decoding control (issue 31): n-gram drafts on or off and K,
the drafted tokens per verify. Applied in place (no pool rebuild), like the scheduling
policy; the engine's back-off still skips drafting where it measured no gain."""
from __future__ import annotations

from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QSpinBox, QWidget

from kvscope.ipc.messages import EngineSettings
from kvscope.ipc.settings import MAX_SPECULATIVE_TOKENS as MAX_K

KEYS = ("speculative_method", "num_speculative_tokens")
TIP = ("Draft up to K tokens per step from the conversation itself (the tokens that followed "
       "the last earlier occurrence of the reply's last few tokens) and verify them in one "
       "pass: faster replies when the reply repeats its input (quoting, summarising, code "
       "edits). Output is unchanged. The engine stops drafting, per step, where it measured "
       "no gain (a large batch, drafts rejected).")


class SpecControl(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.enabled_box = QCheckBox("n-gram drafts")
        self.enabled_box.setObjectName("speculativeDecoding")
        self.enabled_box.setToolTip(TIP)
        self.k = QSpinBox()
        self.k.setRange(1, MAX_K)
        self.k.setValue(4)
        self.k.setPrefix("K = ")
        self.k.setToolTip("drafted tokens per verify")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.enabled_box)
        row.addWidget(self.k)
        row.addStretch(1)

    def values(self) -> dict:
        return {"speculative_method": "ngram" if self.enabled_box.isChecked() else "off",
                "num_speculative_tokens": self.k.value()}

    def show_config(self, config: EngineSettings) -> None:
        # An engine older than issue 31 sends neither: EngineSettings' defaults (off, 4).
        self.enabled_box.setChecked(config.speculative_method != "off")
        self.k.setValue(config.num_speculative_tokens)

    def set_enabled(self, enabled: bool) -> None:
        self.enabled_box.setEnabled(enabled)
        self.k.setEnabled(enabled)
