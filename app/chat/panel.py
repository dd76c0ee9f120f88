"""Chat: several conversations, replies streamed in by appending only the new text.

Deltas are buffered by the bridge and arrive here ~30 times a second; each batch becomes one
insertText at the end of the document per reply, never a re-render of the transcript.
Click a reply (its header, text or stats line) to select its request in the block map: every
part of a reply is a link to "request:<id>".
With "Interactive (priority)" on (the default) the window's own chat goes in at priority -1,
ahead of the load generator's and replays' 0 when the engine schedules by priority.
"""
from __future__ import annotations

import html
import itertools
import time
import uuid

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QColor, QKeyEvent, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QTabWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import colors
from kvscope.app.chat.turn import Turn

INTERACTIVE_PRIORITY = -1  # lower = sooner (vLLM's convention); everything else sends 0
BATCH_PRIORITY = 0
INTERACTIVE_TIP = (
    "On: this chat's requests go in at priority -1, off: at 0 like the load generator's. "
    "Lower = sooner. It matters only while the engine schedules by priority (Engine tab > "
    "scheduling: priority): then a waiting chat reply is scheduled before priority-0 work "
    "and may preempt it when memory runs short. Under fcfs it changes nothing.")


class ChatInput(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a newline."""

    sendRequested = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and \
                not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.sendRequested.emit()
            return
        super().keyPressEvent(event)


class ConversationView(QTextBrowser):
    """One transcript. Everything is appended at the end of the document."""

    requestClicked = Signal(str)

    def __init__(self, index: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.index = index
        self.messages: list[dict] = []
        self.turn: Turn | None = None  # the reply in flight, if any
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._anchor)
        self._text_format = QTextCharFormat()
        self._text_format.setForeground(QColor("#e6e6e6"))
        self._reply_format = self._text_format
        # Following is a state, not a test made when text arrives: appending a header or a
        # line grows the range before the next check, so "at the bottom now" is already false
        # then. It changes only when the user scrolls (up: stop; back to the bottom: resume).
        self.following = True
        self._pinning = False
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._scrolled)
        bar.rangeChanged.connect(self._range_changed)

    def _end(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _new_block(self, spacing: int = 10) -> QTextCursor:
        """A new paragraph at the end (the first one reuses the empty document block)."""
        cursor = self._end()
        if not self.document().isEmpty():
            fmt = QTextBlockFormat()
            fmt.setTopMargin(spacing)
            cursor.insertBlock(fmt, QTextCharFormat())
        return cursor

    def at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scrolled(self, _value: int) -> None:
        if not self._pinning:
            self.following = self.at_bottom()

    def _range_changed(self, _minimum: int, _maximum: int) -> None:
        # The document lays itself out lazily, so the range can grow after the insert that
        # caused it: pinning on every growth keeps the last line in view whenever it lands.
        if self.following:
            self._pin_to_bottom()

    def _pin_to_bottom(self) -> None:
        self._pinning = True
        try:
            bar = self.verticalScrollBar()
            bar.setValue(bar.maximum())
        finally:
            self._pinning = False

    def _keep_following(self) -> None:
        if self.following:
            self._pin_to_bottom()

    def append_user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        body = html.escape(text).replace("\n", "<br>")
        cursor = self._new_block()
        cursor.insertHtml(f"<b style='color:#8ab4f8'>You</b><br>{body}")
        self.following = True  # the user's own message: show it and what answers it
        self._pin_to_bottom()

    def begin_reply(self, turn: Turn) -> None:
        self.turn = turn
        rgb = colors.hex_color(colors.request_rgb(turn.request_id))
        cursor = self._new_block()
        cursor.insertHtml(
            f"<a href='request:{turn.request_id}' style='color:{rgb};text-decoration:none'>"
            f"<b>■ Assistant</b> <span style='color:#8a8f98'>"
            f"({html.escape(turn.request_id)})</span></a>")
        self._new_block(spacing=0)
        # The body is a link too, without a link's look: clicking anywhere in a reply
        # selects it, not only the small header.
        self._reply_format = QTextCharFormat(self._text_format)
        self._reply_format.setAnchor(True)
        self._reply_format.setAnchorHref(f"request:{turn.request_id}")
        self._keep_following()

    def append_reply_text(self, text: str) -> None:
        if text:
            self._end().insertText(text, self._reply_format)
            self._keep_following()

    def end_reply(self, turn: Turn) -> None:
        color = "#e06c75" if turn.error else "#8a8f98"
        note = f"⚠ {html.escape(turn.error)}<br>" if turn.error else ""
        self._new_block(spacing=2).insertHtml(
            f"<a href='request:{turn.request_id}' style='text-decoration:none'>"
            f"<span style='color:{color};font-size:small'>{note}"
            f"{html.escape(turn.stats_text())}</span></a>")
        self.messages.append({"role": "assistant", "content": turn.text})
        self.turn = None
        self._reply_format = self._text_format
        self._keep_following()

    def clear_conversation(self) -> None:
        self.messages.clear()
        self.clear()
        self.following = True

    def _anchor(self, url: QUrl) -> None:
        text = url.toString()
        if text.startswith("request:"):
            self.requestClicked.emit(text.removeprefix("request:"))


class ChatPanel(QWidget):
    submitRequested = Signal(str, object, object)  # request id, messages, sampling dict
    abortRequested = Signal(str)
    requestSelected = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.turns: dict[str, Turn] = {}
        self._engine_alive = True
        self._engine_reason = ""
        self._numbers = itertools.count(1)
        self.tabs = QTabWidget()
        self.tabs.setTabsClosable(True)
        self.tabs.setDocumentMode(True)
        self.tabs.tabCloseRequested.connect(self.close_conversation)
        self.tabs.currentChanged.connect(lambda _i: self._update_buttons())
        self.new_button = QPushButton("New")
        self.new_button.setToolTip("New conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_conversation)
        self.clear_button = QPushButton("Clear")
        self.clear_button.clicked.connect(self.clear_conversation)
        self.phase_label = QLabel("")
        self.phase_label.setObjectName("phaseLabel")
        self.input = ChatInput()
        self.input.setPlaceholderText("Message the model — Enter sends, Shift+Enter newline, "
                                      "Esc stops")
        self.input.setFixedHeight(70)
        self.input.sendRequested.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.clicked.connect(self.stop)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setValue(256)
        self.max_tokens.setPrefix("max ")
        self.max_tokens.setSuffix(" tok")
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(0.7)
        self.temperature.setPrefix("T ")
        self.interactive = QCheckBox("Interactive (priority)")
        self.interactive.setObjectName("interactiveToggle")
        self.interactive.setChecked(True)
        self.interactive.setToolTip(INTERACTIVE_TIP)
        # A long phase line must not widen the dock: it gets what the toggle leaves.
        self.phase_label.setSizePolicy(QSizePolicy.Policy.Ignored,
                                       QSizePolicy.Policy.Preferred)

        top = QHBoxLayout()
        title = QLabel("Chat")
        title.setObjectName("panelTitle")
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(self.new_button)
        top.addWidget(self.clear_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.max_tokens)
        bottom.addWidget(self.temperature)
        bottom.addStretch(1)
        bottom.addWidget(self.stop_button)
        bottom.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.tabs, 1)
        phase_row = QHBoxLayout()
        phase_row.addWidget(self.phase_label, 1)
        phase_row.addWidget(self.interactive)
        layout.addLayout(phase_row)
        layout.addWidget(self.input)
        layout.addLayout(bottom)
        self.new_conversation()

    # -- conversations ----------------------------------------------------------------------
    def conversation(self, index: int | None = None) -> ConversationView:
        return self.tabs.widget(self.tabs.currentIndex() if index is None else index)

    def _by_number(self, number: int) -> ConversationView | None:
        for i in range(self.tabs.count()):
            if self.tabs.widget(i).index == number:
                return self.tabs.widget(i)
        return None

    def new_conversation(self) -> ConversationView:
        view = ConversationView(next(self._numbers))
        view.requestClicked.connect(self.select_request)
        self.tabs.addTab(view, f"Chat {view.index}")
        self.tabs.setCurrentWidget(view)
        self.input.setFocus()
        return view

    def clear_conversation(self) -> None:
        view = self.conversation()
        if view.turn is not None:
            self.abortRequested.emit(view.turn.request_id)
        view.clear_conversation()

    def close_conversation(self, index: int) -> None:
        view = self.conversation(index)
        if view.turn is not None:
            self.abortRequested.emit(view.turn.request_id)
        self.tabs.removeTab(index)
        view.deleteLater()
        if self.tabs.count() == 0:
            self.new_conversation()

    # -- commands ---------------------------------------------------------------------------
    def priority(self) -> int:
        return INTERACTIVE_PRIORITY if self.interactive.isChecked() else BATCH_PRIORITY

    def sampling(self) -> dict:
        return {"max_tokens": self.max_tokens.value(), "temperature": self.temperature.value(),
                "priority": self.priority()}

    def send(self) -> str | None:
        """Send the input as the next user message; returns the new request id."""
        text = self.input.toPlainText().strip()
        view = self.conversation()
        if not text or view.turn is not None or not self._engine_alive:
            return None
        self.input.clear()
        view.append_user(text)
        turn = Turn(f"chat-{uuid.uuid4().hex[:8]}", view.index, priority=self.priority())
        self.turns[turn.request_id] = turn
        view.begin_reply(turn)
        self.submitRequested.emit(turn.request_id, list(view.messages), self.sampling())
        self._update_buttons()
        return turn.request_id

    def stop(self) -> None:
        view = self.conversation()
        if view.turn is not None:
            self.abortRequested.emit(view.turn.request_id)

    def select_request(self, request_id: str) -> None:
        self.requestSelected.emit(request_id)

    # -- engine facts -------------------------------------------------------------------------
    def on_deltas(self, deltas: list) -> None:
        """Append each reply's new text once per batch (deltas of other clients are ignored)."""
        now = time.monotonic()
        pending: dict[str, list[str]] = {}
        for d in deltas:
            turn = self.turns.get(d.request_id)
            if turn is None or turn.done:
                continue
            turn.on_delta(d, now)
            pending.setdefault(d.request_id, []).append(d.text)
        for rid, texts in pending.items():
            turn = self.turns[rid]
            view = self._by_number(turn.conversation)
            if view is None:
                continue
            view.append_reply_text("".join(texts))
            if turn.done:
                view.end_reply(turn)
        if pending:
            self._update_buttons()

    def on_blocks(self, frame) -> None:
        for turn in self.turns.values():
            if not turn.done:
                turn.on_blocks(frame)

    def on_submit_failed(self, request_id: str, message: str) -> None:
        self._fail(request_id, message)

    def fail_all(self, reason: str) -> None:
        """The engine died: every reply in flight is marked failed, none left spinning."""
        for rid, turn in list(self.turns.items()):
            if not turn.done:
                self._fail(rid, reason)

    def _fail(self, request_id: str, message: str) -> None:
        turn = self.turns.get(request_id)
        if turn is None or turn.done:
            return
        turn.fail(message)
        view = self._by_number(turn.conversation)
        if view is not None and view.turn is turn:
            view.end_reply(turn)
        self._update_buttons()

    def set_engine_alive(self, alive: bool, reason: str = "") -> None:
        """Send (button and Enter) works only while an engine can take the message."""
        self._engine_alive = alive
        self._engine_reason = reason
        self._update_buttons()

    def in_flight(self) -> list[Turn]:
        return [t for t in self.turns.values() if not t.done]

    def refresh_labels(self) -> None:
        """The current conversation's phase line (a few times a second)."""
        view = self.conversation()
        turn = view.turn if view is not None else None
        self.phase_label.setText("" if turn is None else f"● {turn.phase_text()}")

    def _update_buttons(self) -> None:
        view = self.conversation()
        busy = view is not None and view.turn is not None
        self.send_button.setEnabled(not busy and self._engine_alive)
        self.send_button.setToolTip("" if self._engine_alive
                                    else f"Engine unavailable: {self._engine_reason}")
        self.stop_button.setEnabled(busy)
        self.refresh_labels()
