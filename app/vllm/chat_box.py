"""Chat with the attached server through its OpenAI API. The request runs on a worker thread that
only appends text pieces to a locked mailbox; the window's timer moves them into the widgets.
The worker holds the mailbox and the client, never the widget: a Qt object whose last
reference drops in a worker thread is destroyed there."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from kvscope.app.vllm.openai_chat import OpenAIChat, OpenAIError


@dataclass
class Mailbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pieces: list[str] = field(default_factory=list)
    done: str | None = None  # "" when the reply ended well, else the error
    model: str | None = None

    def take(self) -> tuple[list[str], str | None]:
        with self.lock:
            pieces, self.pieces = self.pieces, []
            done, self.done = self.done, None
        return pieces, done


def ask(client: OpenAIChat, messages: list[dict], box: Mailbox) -> None:
    """Worker thread: stream one reply into `box`."""
    try:
        if box.model is None:
            models = client.models()
            if not models:
                raise OpenAIError("the server lists no models")
            box.model = models[0]
        for piece in client.stream_chat(messages, box.model):
            with box.lock:
                box.pieces.append(piece)
        outcome = ""
    except OpenAIError as exc:
        outcome = str(exc)
    with box.lock:
        box.done = outcome


class ChatBox(QWidget):
    def __init__(self, client: OpenAIChat, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.messages: list[dict] = []
        self.box = Mailbox()
        self._worker: threading.Thread | None = None
        self._reply = ""
        self.transcript = QPlainTextEdit()
        self.transcript.setReadOnly(True)
        self.input = QPlainTextEdit()
        self.input.setMaximumHeight(70)
        self.input.setPlaceholderText("Message the server (OpenAI chat API)")
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.status = QLabel("")
        title = QLabel("Chat (OpenAI API)")
        title.setObjectName("panelTitle")
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(title)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(row)
        layout.addWidget(self.status)

    def busy(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def send(self) -> bool:
        text = self.input.toPlainText().strip()
        if not text or self.busy():
            return False
        self.input.clear()
        self.messages.append({"role": "user", "content": text})
        self.transcript.appendPlainText(f"You: {text}\nAssistant: ")
        self._reply = ""
        self.send_button.setEnabled(False)
        self._worker = threading.Thread(target=ask, args=(self.client, list(self.messages),
                                                          self.box),
                                        name="kvscope-openai-chat", daemon=True)
        self._worker.start()
        return True

    @property
    def model(self) -> str | None:
        return self.box.model

    def refresh(self) -> None:
        """Move what the worker received into the widgets (the window's timer calls this)."""
        pieces, done = self.box.take()
        if pieces:
            text = "".join(pieces)
            self._reply += text
            self.transcript.moveCursor(QTextCursor.MoveOperation.End)
            self.transcript.insertPlainText(text)
        if done is not None:
            if done:
                self.transcript.appendPlainText(f"[error: {done}]")
                self.messages.pop()  # the turn did not happen
            else:
                self.messages.append({"role": "assistant", "content": self._reply})
            self.status.setText(f"model {self.model}" if self.model else "")
            self.send_button.setEnabled(True)

    def close_worker(self) -> None:
        if self._worker is not None:
            self._worker.join(10)
