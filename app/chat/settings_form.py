"""A conversation's system prompt and sampling (top-p, top-k, penalties, seed, stop strings).

Temperature and max tokens stay in the chat's bottom row, where they are changed most; the
rest fold away under "Settings". Values are read when a message is sent and when another
conversation is shown, not on every keystroke: that is when they are saved.
"""
from __future__ import annotations

import re

from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLineEdit,
    QPlainTextEdit,
    QSpinBox,
    QWidget,
)

from kvscope.app.chat.conversation import ChatSettings

STOP_TIP = ("Strings that end the reply, separated by | (write \\n for a newline, \\| for a "
            "bar). The stop string itself is not shown.")


def parse_stop(text: str) -> list[str]:
    """Stop strings from "a | b": split at unescaped bars, spaces around each trimmed, then
    \\n, \\| and \\\\ unescaped (so a stop string may be a newline)."""
    pieces, current, i = [], "", 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            current += text[i:i + 2]
            i += 2
            continue
        if text[i] == "|":
            pieces.append(current)
            current = ""
        else:
            current += text[i]
        i += 1
    pieces.append(current)
    out = []
    for piece in pieces:
        piece = piece.strip(" \t")
        value = re.sub(r"\\([n|\\])", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), piece)
        if value:
            out.append(value)
    return out


def format_stop(stop: list[str]) -> str:
    return " | ".join(s.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")
                      for s in stop)


def _double(low: float, high: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


class SettingsForm(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional): how the model "
                                              "should behave in this conversation")
        self.system_prompt.setFixedHeight(54)
        self.top_p = _double(0.01, 1.0, 0.05)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100_000)
        self.top_k.setSpecialValueText("off")
        self.repetition_penalty = _double(0.05, 3.0, 0.05)
        self.repetition_penalty.setToolTip("Hugging Face's: the logits of tokens already in "
                                           "the conversation are divided by it. 1 = off.")
        self.presence_penalty = _double(-2.0, 2.0, 0.1)
        self.presence_penalty.setToolTip("OpenAI's: subtracted once from each token the reply "
                                         "already holds. 0 = off.")
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.stop = QLineEdit()
        self.stop.setPlaceholderText("none")
        self.stop.setToolTip(STOP_TIP)
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow(self.system_prompt)
        row1 = QHBoxLayout()
        for label, box in (("top-p", self.top_p), ("top-k", self.top_k), ("seed", self.seed)):
            box.setPrefix(f"{label} ")
            row1.addWidget(box)
        form.addRow(row1)
        row2 = QHBoxLayout()
        self.repetition_penalty.setPrefix("repetition ")
        self.presence_penalty.setPrefix("presence ")
        row2.addWidget(self.repetition_penalty)
        row2.addWidget(self.presence_penalty)
        form.addRow(row2)
        form.addRow("stop", self.stop)

    def load(self, system_prompt: str, s: ChatSettings) -> None:
        self.system_prompt.setPlainText(system_prompt)
        self.top_p.setValue(s.top_p)
        self.top_k.setValue(s.top_k)
        self.repetition_penalty.setValue(s.repetition_penalty)
        self.presence_penalty.setValue(s.presence_penalty)
        self.seed.setValue(-1 if s.seed is None else s.seed)
        self.stop.setText(format_stop(s.stop))

    def read(self, temperature: float, max_tokens: int) -> tuple[str, ChatSettings]:
        seed = self.seed.value()
        return self.system_prompt.toPlainText().strip(), ChatSettings(
            temperature=temperature, top_p=self.top_p.value(), top_k=self.top_k.value(),
            max_tokens=max_tokens, repetition_penalty=self.repetition_penalty.value(),
            presence_penalty=self.presence_penalty.value(), seed=None if seed < 0 else seed,
            stop=parse_stop(self.stop.text()))
