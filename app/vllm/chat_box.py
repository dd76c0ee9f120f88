"""Chat with the attached server through its OpenAI API. The request runs on a worker thread that
only appends text pieces to a locked list; the window's timer moves them into the widgets."""
from __future__ import annotations

import threading

from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app.vllm.openai_chat import OpenAIChat, OpenAIError


class ChatBox(QWidget):
    def __init__(self, client: OpenAIChat, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.messages: list[dict] = []
        self.model: str | None = None
        self._lock = threading.Lock()
        self._pieces: list[str] = []
        self._done: str | None = None  # "" when the reply ended well, else the error
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
        self._reply, self._done = "", None
        self.send_button.setEnabled(False)
        self._worker = threading.Thread(target=self._ask, args=(list(self.messages),),
                                        name="kvscope-openai-chat", daemon=True)
        self._worker.start()
        return True

    def _ask(self, messages: list[dict]) -> None:
        try:
            if self.model is None:
                models = self.client.models()
                if not models:
                    raise OpenAIError("the server lists no models")
                self.model = models[0]
            for piece in self.client.stream_chat(messages, self.model):
                with self._lock:
                    self._pieces.append(piece)
            outcome = ""
        except OpenAIError as exc:
            outcome = str(exc)
        with self._lock:
            self._done = outcome

    def refresh(self) -> None:
        """Move what the worker received into the widgets (the window's timer calls this)."""
        with self._lock:
            pieces, self._pieces = self._pieces, []
            done, self._done = self._done, None
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
