"""Chat: conversations that are saved as they go, listed in a sidebar, replies streamed in.

Deltas are buffered by the bridge and arrive here once per drain (up to ~30 times a second);
the reply in flight re-renders its tail (app.chat.view), never the transcript above it, and
at most RENDER_HZ times a second: a streaming reply's Markdown, its code highlighting and the
transcript's repaint were most of what the window cost the engine (docs/window.md).
Conversations are saved by app.chat.store (one JSON Lines file each) when a store is given;
without one (tests) they live in memory only. Regenerate and edit discard
the replies after the point they restart from: the old branch is not kept.
A message sent while the engine loads is held (shown as queued) and sent once it is ready.
With "Interactive (priority)" on (the default) the window's own chat goes in at priority -1,
ahead of the load generator's and replays' 0 when the engine schedules by priority.
"""
from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QStackedWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import stale
from kvscope.app.chat.conversation import (
    Conversation,
    Event,
    Message,
    Retitle,
    SetSettings,
    SetSystemPrompt,
    Truncate,
)
from kvscope.app.chat.settings_form import SettingsForm
from kvscope.app.chat.store import ChatStore
from kvscope.app.chat.turn import HELD, SENDING, Turn
from kvscope.app.chat.view import ConversationView
from kvscope.app.elided_label import ElidedLabel

INTERACTIVE_PRIORITY = -1  # lower = sooner (vLLM's convention); everything else sends 0
BATCH_PRIORITY = 0
INTERACTIVE_TIP = (
    "On: this chat's requests go in at priority -1, off: at 0 like the load generator's. "
    "Lower = sooner. It matters only while the engine schedules by priority (Engine tab > "
    "scheduling: priority): then a waiting chat reply is scheduled before priority-0 work "
    "and may preempt it when memory runs short. Under fcfs it changes nothing.")
EDIT_NOTE = ("Editing message {n}: sending replaces it, and the replies after it are "
             "discarded (not kept as a branch). Esc cancels.")
TITLE_CHARS = 40
RENDER_HZ = 4  # the reply in flight re-renders at most this often; its end renders at once
PLACEHOLDER = "Message the model — Enter sends, Shift+Enter newline, Esc stops"
ALIVE, LOADING, DEAD = "alive", "loading", "dead"


class ChatInput(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a newline."""

    sendRequested = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and \
                not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.sendRequested.emit()
            return
        super().keyPressEvent(event)


def _confirm_delete(parent: QWidget, title: str) -> bool:
    answer = QMessageBox.question(parent, "Delete conversation",
                                  f"Delete “{title}”? You can undo it until you quit.")
    return answer == QMessageBox.StandardButton.Yes


class ChatPanel(QWidget):
    submitRequested = Signal(str, object, object)  # request id, messages, sampling dict
    abortRequested = Signal(str)
    requestSelected = Signal(str)
    noticed = Signal(str)  # something the user should read (restore warnings, copies)

    def __init__(self, store: ChatStore | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.turns: dict[str, Turn] = {}
        self._engine_state = ALIVE
        self._engine_reason = ""
        self._held: list[tuple[str, list[dict], dict]] = []
        self._numbers = itertools.count(1)
        self._editing: tuple[ConversationView, int] | None = None
        self._deleted: ConversationView | None = None
        self._shown: ConversationView | None = None
        self.render_interval_s = 1.0 / RENDER_HZ
        self.clock: Callable[[], float] = time.monotonic
        self._rendered_at: dict[int, float] = {}  # view number -> when its reply last rendered
        self._unrendered: set[int] = set()  # views whose reply has text not on screen yet
        self.context_limit: int | None = None
        self.warnings: list[str] = []
        self.confirm_delete: Callable[[QWidget, str], bool] = _confirm_delete
        self._build()
        if store is not None:
            conversations, self.warnings = store.load_all()
            for c in conversations:
                self._add_view(c)
        if self.stack.count() == 0:
            self.new_conversation()
        else:
            self.show_conversation(self.stack.count() - 1)

    def _build(self) -> None:
        self.stack = QStackedWidget()
        self.stack.currentChanged.connect(self._shown_changed)
        self.sidebar = QListWidget()
        self.sidebar.setObjectName("chatSidebar")
        self.sidebar.currentRowChanged.connect(self.show_conversation)
        self.sidebar.itemChanged.connect(self._item_renamed)
        self.sidebar.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.sidebar.customContextMenuRequested.connect(
            lambda pos: self._menu().exec(self.sidebar.mapToGlobal(pos)))
        self.sidebar.setToolTip("Conversations, saved as they go. Double-click to rename.")
        self.sidebar.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.sidebar.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(self.stack)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([130, 400])
        self.splitter.setCollapsible(1, False)

        self.sidebar_button = QToolButton()
        self.sidebar_button.setText("☰")
        self.sidebar_button.setCheckable(True)
        self.sidebar_button.setChecked(True)
        self.sidebar_button.setToolTip("Show or hide the list of conversations")
        self.sidebar_button.toggled.connect(self.sidebar.setVisible)
        self.new_button = QPushButton("New")
        self.new_button.setToolTip("New conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_conversation)
        self.more_button = QToolButton()
        self.more_button.setText("⋯")
        self.more_button.setToolTip("Rename, delete or export this conversation")
        self.more_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.more_button.setMenu(self._menu())
        self.undo_label = QLabel("")
        self.undo_button = QPushButton("Undo")
        self.undo_button.clicked.connect(self.undo_delete)
        self.undo_row = QWidget()
        undo = QHBoxLayout(self.undo_row)
        undo.setContentsMargins(0, 0, 0, 0)
        undo.addWidget(self.undo_label, 1)
        undo.addWidget(self.undo_button)
        self.undo_row.hide()

        self.settings_button = QToolButton()
        self.settings_button.setText("Settings")
        self.settings_button.setCheckable(True)
        self.settings_button.setToolTip("This conversation's system prompt and sampling")
        self.settings = SettingsForm()
        self.settings.hide()
        self.settings_button.toggled.connect(self.settings.setVisible)
        self.context_label = QLabel("")  # a row of its own: the dock's whole width
        self.context_label.setObjectName("contextMeter")
        self.context_label.setSizePolicy(QSizePolicy.Policy.Ignored,
                                         QSizePolicy.Policy.Preferred)
        self.context_label.setToolTip("Tokens this conversation's last request used out of "
                                      "the model's context, and the KV blocks its request "
                                      "holds now (0 once it has finished)")

        # A row of its own, the dock's whole width: beside the Interactive toggle it was cut
        # to a few words. A longer line than the dock is wide ends in "…" (the whole line is
        # its tooltip); it never widens the dock.
        self.phase_label = ElidedLabel("")
        self.phase_label.setObjectName("phaseLabel")
        self.interactive = QCheckBox("Interactive")
        self.interactive.setObjectName("interactiveToggle")
        self.interactive.setChecked(True)
        self.interactive.setToolTip(INTERACTIVE_TIP)
        self.edit_label = QLabel("")
        self.edit_label.setWordWrap(True)
        self.edit_label.hide()
        self.input = ChatInput()
        self.input.setPlaceholderText(PLACEHOLDER)
        self.input.setFixedHeight(70)
        self.input.sendRequested.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.clicked.connect(self.stop)
        self.regenerate_button = QToolButton()  # small: the row must fit a narrow dock
        self.regenerate_button.setText("↻")
        self.regenerate_button.setToolTip("Regenerate the last reply (it is replaced)")
        self.regenerate_button.clicked.connect(self.regenerate)
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

        top = QHBoxLayout()
        top.addWidget(self.sidebar_button)
        title = QLabel("Chat")
        title.setObjectName("panelTitle")
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(self.regenerate_button)
        top.addWidget(self.new_button)
        top.addWidget(self.more_button)
        meter = QHBoxLayout()
        meter.addWidget(self.settings_button)
        meter.addWidget(self.interactive)
        meter.addStretch(1)
        bottom = QHBoxLayout()
        bottom.addWidget(self.max_tokens)
        bottom.addWidget(self.temperature)
        bottom.addStretch(1)
        bottom.addWidget(self.stop_button)
        bottom.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.undo_row)
        layout.addWidget(self.splitter, 1)
        layout.addLayout(meter)
        layout.addWidget(self.settings)
        layout.addWidget(self.context_label)
        layout.addWidget(self.phase_label)
        layout.addWidget(self.edit_label)
        layout.addWidget(self.input)
        layout.addLayout(bottom)

    def _menu(self) -> QMenu:
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.sidebar.editItem(self.sidebar.currentItem()))
        menu.addAction("Delete…", self.delete_conversation)
        menu.addSeparator()
        menu.addAction("Export as Markdown…", lambda: self.export_dialog("markdown"))
        menu.addAction("Export as JSON…", lambda: self.export_dialog("json"))
        return menu

    # -- conversations ----------------------------------------------------------------------
    def conversation(self, index: int | None = None) -> ConversationView:
        return self.stack.widget(self.stack.currentIndex() if index is None else index)

    def _by_number(self, number: int) -> ConversationView | None:
        for i in range(self.stack.count()):
            if self.stack.widget(i).index == number:
                return self.stack.widget(i)
        return None

    def _add_view(self, conversation: Conversation,
                  view: ConversationView | None = None) -> ConversationView:
        if view is None:
            view = ConversationView(next(self._numbers), conversation)
            view.requestClicked.connect(self.select_request)
            view.actionClicked.connect(self._action)
            view.saved = self.store is not None and bool(conversation.messages)
        self.stack.addWidget(view)
        item = QListWidgetItem(conversation.title)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
        item.setData(Qt.ItemDataRole.UserRole, view.index)
        self.sidebar.blockSignals(True)
        self.sidebar.addItem(item)
        self.sidebar.blockSignals(False)
        return view

    def new_conversation(self) -> ConversationView:
        self.save()
        number = next(self._numbers)
        conversation, _ = Conversation.new(f"{time.strftime('%Y%m%d-%H%M%S')}-"
                                           f"{uuid.uuid4().hex[:6]}", f"Chat {number}")
        if self._shown is not None:  # a new conversation starts with the shown one's settings
            conversation.system_prompt = self._shown.conversation.system_prompt
            conversation.settings = self._shown.conversation.settings
        view = ConversationView(number, conversation)
        view.requestClicked.connect(self.select_request)
        view.actionClicked.connect(self._action)
        view.saved = False  # its file is written with its first message
        self._add_view(conversation, view)
        self.show_conversation(self.stack.count() - 1)
        self.input.setFocus()
        return view

    def show_conversation(self, row: int) -> None:
        if 0 <= row < self.stack.count():
            self.stack.setCurrentIndex(row)
            self.sidebar.blockSignals(True)
            self.sidebar.setCurrentRow(row)
            self.sidebar.blockSignals(False)

    def _shown_changed(self, _index: int) -> None:
        if self._shown is not None and self.stack.indexOf(self._shown) >= 0:
            self.save()
        view = self.conversation()
        self._shown = view
        if view is not None:
            c = view.conversation
            self.settings.load(c.system_prompt, c.settings)
            self.temperature.setValue(c.settings.temperature)
            self.max_tokens.setValue(c.settings.max_tokens)
        self.cancel_edit()
        self._update_buttons()

    def _record(self, view: ConversationView, event: Event) -> None:
        """An event applied to the conversation and appended to its file."""
        view.conversation.apply(event)
        if self.store is None:
            return
        if not view.saved:
            self.store.create(view.conversation.header())
            view.saved = True
            if isinstance(event, (Retitle, SetSettings, SetSystemPrompt)):
                return  # the header written just now already holds it
        self.store.append(view.conversation.id, event)

    def save(self) -> None:
        """The shown conversation's system prompt and sampling, if they changed."""
        view = self._shown
        if view is None or self.stack.indexOf(view) < 0:
            return
        system_prompt, settings = self.settings.read(self.temperature.value(),
                                                     self.max_tokens.value())
        c = view.conversation
        if system_prompt != c.system_prompt:
            self._record(view, SetSystemPrompt(system_prompt=system_prompt))
        if settings != c.settings:
            self._record(view, SetSettings(settings=settings))

    def rename_conversation(self, title: str, view: ConversationView | None = None) -> None:
        view = view or self.conversation()
        title = " ".join(title.split())[:200]
        if not title or title == view.conversation.title:
            return
        self._record(view, Retitle(title=title))
        item = self.sidebar.item(self.stack.indexOf(view))
        self.sidebar.blockSignals(True)
        item.setText(title)
        self.sidebar.blockSignals(False)

    def _item_renamed(self, item: QListWidgetItem) -> None:
        view = self._by_number(item.data(Qt.ItemDataRole.UserRole))
        if view is not None:
            self.rename_conversation(item.text(), view)
            if not item.text().strip():
                self.sidebar.blockSignals(True)
                item.setText(view.conversation.title)
                self.sidebar.blockSignals(False)

    def delete_conversation(self) -> bool:
        """Delete the shown conversation once the user confirms; Undo brings it back."""
        view = self.conversation()
        if not self.confirm_delete(self, view.conversation.title):
            return False
        if view.turn is not None:
            self._abort(view.turn)
        self._forget_deleted()
        self.save()
        row = self.stack.indexOf(view)
        self._shown = None
        self.stack.removeWidget(view)
        self.sidebar.blockSignals(True)
        self.sidebar.takeItem(row)
        self.sidebar.blockSignals(False)
        if self.store is not None and view.saved:
            self.store.delete(view.conversation.id)
        self._deleted = view
        self.undo_label.setText(f"Deleted “{view.conversation.title}”.")
        self.undo_row.show()
        if self.stack.count() == 0:
            self.new_conversation()
        else:
            self.show_conversation(min(row, self.stack.count() - 1))
            self._shown_changed(self.stack.currentIndex())
        return True

    def undo_delete(self) -> None:
        view, self._deleted = self._deleted, None
        self.undo_row.hide()
        if view is None:
            return
        if self.store is not None and view.saved:
            self.store.undelete(view.conversation.id)
        self._add_view(view.conversation, view)
        self.show_conversation(self.stack.count() - 1)

    def _forget_deleted(self) -> None:
        if self._deleted is not None:
            self._deleted.deleteLater()
            self._deleted = None
        self.undo_row.hide()

    def export(self, path: Path, fmt: str, view: ConversationView | None = None) -> None:
        c = (view or self.conversation()).conversation
        data = c.to_json() if fmt == "json" else c.to_markdown().encode()
        Path(path).write_bytes(data)

    def export_dialog(self, fmt: str) -> None:
        c = self.conversation().conversation
        suffix = ".json" if fmt == "json" else ".md"
        safe = "".join(ch if ch.isalnum() or ch in "-_ " else "_" for ch in c.title).strip()
        path, _ = QFileDialog.getSaveFileName(
            self, "Export conversation", f"{safe or 'conversation'}{suffix}",
            "JSON (*.json)" if fmt == "json" else "Markdown (*.md)")
        if path:
            try:
                self.export(Path(path), fmt)
            except OSError as exc:
                self.noticed.emit(f"export failed: {exc}")
            else:
                self.noticed.emit(f"exported to {path}")

    # -- commands ---------------------------------------------------------------------------
    def priority(self) -> int:
        return INTERACTIVE_PRIORITY if self.interactive.isChecked() else BATCH_PRIORITY

    def sampling(self) -> dict:
        _, settings = self.settings.read(self.temperature.value(), self.max_tokens.value())
        return {**settings.sampling(), "priority": self.priority()}

    def send(self) -> str | None:
        """Send the input as the next user message; returns the new request id."""
        text = self.input.toPlainText().strip()
        view = self.conversation()
        if not text or view.turn is not None or self._engine_state == DEAD:
            return None
        self.input.clear()
        self.save()
        if self._editing is not None and self._editing[0] is view:
            self._record(view, Truncate(keep=self._editing[1]))
            view.render_all()
        self.cancel_edit()
        c = view.conversation
        if not c.messages and c.title == f"Chat {view.index}":
            self.rename_conversation(text.splitlines()[0][:TITLE_CHARS], view)
        self._record(view, Message(role="user", content=text))
        view.append_user(text)
        return self._submit(view)

    def regenerate(self) -> str | None:
        """Replace the last reply with a new one (the old one is discarded)."""
        view = self.conversation()
        c = view.conversation
        if view.turn is not None or not c.messages or c.messages[-1].role != "assistant" \
                or self._engine_state == DEAD:
            return None
        self.save()
        self._record(view, Truncate(keep=len(c.messages) - 1))
        view.render_all()
        return self._submit(view)

    def _submit(self, view: ConversationView) -> str:
        turn = Turn(f"chat-{uuid.uuid4().hex[:8]}", view.index, priority=self.priority())
        self.turns[turn.request_id] = turn
        view.begin_reply(turn)
        messages, sampling = view.conversation.prompt_messages(), self.sampling()
        if self._engine_state == LOADING:
            turn.phase = HELD
            self._held.append((turn.request_id, messages, sampling))
        else:
            self.submitRequested.emit(turn.request_id, messages, sampling)
        self._update_buttons()
        return turn.request_id

    def edit_message(self, index: int) -> None:
        """Put a past message of the user's in the input; sending continues from it."""
        view = self.conversation()
        c = view.conversation
        if view.turn is not None or not 0 <= index < len(c.messages) \
                or c.messages[index].role != "user":
            return
        self._editing = (view, index)
        self.input.setPlainText(c.messages[index].content)
        self.edit_label.setText(EDIT_NOTE.format(n=index + 1))
        self.edit_label.show()
        self.input.setFocus()

    def cancel_edit(self) -> None:
        if self._editing is not None:
            self._editing = None
            self.edit_label.hide()

    def stop(self) -> None:
        if self._editing is not None:
            self.cancel_edit()
            self.input.clear()
            return
        view = self.conversation()
        if view.turn is not None:
            self._abort(view.turn)

    def _abort(self, turn: Turn) -> None:
        if turn.phase == HELD:
            self._held = [h for h in self._held if h[0] != turn.request_id]
            self._fail(turn.request_id, "stopped before the engine was ready")
        else:
            self.abortRequested.emit(turn.request_id)

    def select_request(self, request_id: str) -> None:
        self.requestSelected.emit(request_id)

    def _action(self, kind: str, index: int) -> None:
        view = self.sender()
        if not isinstance(view, ConversationView):
            return
        if kind == "edit":
            self.edit_message(index)
        elif kind == "copy-reply" and index < len(view.conversation.messages):
            self.copy(view.conversation.messages[index].content, "reply")
        elif kind == "copy-code" and index < len(view.code_blocks):
            self.copy(view.code_blocks[index], "code block")

    def copy(self, text: str, what: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.noticed.emit(f"copied the {what} ({len(text)} characters)")

    # -- engine facts -------------------------------------------------------------------------
    def on_deltas(self, deltas: list) -> None:
        """Each reply's new text, at most RENDER_HZ times a second (deltas of other clients
        are ignored); a finished reply at once."""
        now = self.clock()
        pending: set[str] = set()
        for d in deltas:
            turn = self.turns.get(d.request_id)
            if turn is None or turn.done:
                continue
            turn.on_delta(d, now)
            pending.add(d.request_id)
        for rid in pending:
            turn = self.turns[rid]
            view = self._by_number(turn.conversation)
            if view is None or view.turn is not turn:
                continue
            if turn.done:
                self._unrendered.discard(view.index)
                self._finish(view, turn)
            elif now - self._rendered_at.get(view.index, -1e9) >= self.render_interval_s:
                self._render_reply(view, now)
            else:
                self._unrendered.add(view.index)  # the next batch or label tick draws it
        if pending:
            self._update_buttons()

    def _render_reply(self, view: ConversationView, now: float) -> None:
        self._unrendered.discard(view.index)
        self._rendered_at[view.index] = now
        if view.turn is not None:
            view.update_reply(view.turn.text)

    def flush_replies(self) -> None:
        """Draw the text of every reply in flight that is not on screen yet (the window's
        label clock calls it: a reply whose engine went quiet is not left behind)."""
        now = self.clock()
        for number in list(self._unrendered):
            view = self._by_number(number)
            if view is None or view.turn is None:
                self._unrendered.discard(number)
            else:
                self._render_reply(view, now)

    def _finish(self, view: ConversationView, turn: Turn) -> None:
        index = len(view.conversation.messages)
        self._record(view, Message(role="assistant", content=turn.text,
                                   stats=turn.stats_text(), error=turn.error or "",
                                   tokens=turn.num_prompt + turn.num_output))
        view.end_reply(turn, index)

    def on_blocks(self, frame) -> None:
        for turn in self.turns.values():
            if not turn.done:
                turn.on_blocks(frame)

    def on_submit_failed(self, request_id: str, message: str) -> None:
        self._fail(request_id, message)

    def fail_all(self, reason: str) -> None:
        """The engine died: every reply in flight is marked failed, none left spinning."""
        self._held.clear()
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
            self._finish(view, turn)
        self._update_buttons()

    def set_engine_alive(self, alive: bool, reason: str = "") -> None:
        """Alive: send works, and what was held while the engine loaded goes out now. Dead:
        Send (button and Enter) is off until an engine can take the message."""
        self._engine_state = ALIVE if alive else DEAD
        self._engine_reason = reason
        if alive:
            held, self._held = self._held, []
            for rid, messages, sampling in held:
                turn = self.turns.get(rid)
                if turn is not None and not turn.done:
                    turn.phase, turn.submitted_at = SENDING, time.monotonic()
                    self.submitRequested.emit(rid, messages, sampling)
        self._update_buttons()

    def set_engine_loading(self, reason: str = "the engine is loading") -> None:
        """Messages sent from now on are held and go out once set_engine_alive(True)."""
        self._engine_state = LOADING
        self._engine_reason = reason
        self._update_buttons()

    def set_context_limit(self, tokens: int | None) -> None:
        self.context_limit = tokens
        self.refresh_labels()

    def in_flight(self) -> list[Turn]:
        return [t for t in self.turns.values() if not t.done]

    def context_text(self) -> str:
        view = self.conversation()
        if view is None:
            return ""
        turn = view.turn
        if turn is not None:
            used, blocks = turn.num_prompt + turn.num_output, turn.blocks_now
        else:
            used = next((m.tokens for m in reversed(view.conversation.messages)
                         if m.role == "assistant"), 0)
            blocks = 0
        limit = f"{self.context_limit:,}" if self.context_limit else "?"
        return f"context {used:,} / {limit} tok · {blocks} KV blocks held"

    def refresh_labels(self) -> None:
        """The current conversation's phase line and context meter (a few times a second)."""
        view = self.conversation()
        turn = view.turn if view is not None else None
        if turn is not None:
            phase = f"● {turn.phase_text()}"
        elif self._engine_state == DEAD:
            phase = f"{stale.NOTE} Send waits for a restart"  # why: the status bar
        elif self._engine_state == LOADING:
            phase = f"● {self._engine_reason}"
        else:
            phase = ""
        if phase != self.phase_label.text():
            self.phase_label.setText(phase)
        # A dead engine's blocks are no one's now: the meter says it is old.
        dead = self._engine_state == DEAD
        context = self.context_text()
        if dead:  # no blocks are held by a dead engine: the tokens only, marked old
            context = stale.plain(context.split(" · ")[0])
        stale.mark(self.context_label, dead)
        if context != self.context_label.text():
            self.context_label.setText(context)

    def _update_buttons(self) -> None:
        view = self.conversation()
        busy = view is not None and view.turn is not None
        self.send_button.setEnabled(not busy and self._engine_state != DEAD)
        tip = {ALIVE: "", DEAD: f"Engine unavailable: {self._engine_reason}",
               LOADING: f"{self._engine_reason}: a message sent now is queued and goes out "
                        "once the engine is ready"}[self._engine_state]
        self.send_button.setToolTip(tip)
        placeholder = {ALIVE: PLACEHOLDER,
                       LOADING: f"{self._engine_reason}: a message sent now waits for the "
                                "engine",
                       DEAD: "Engine unavailable: Send waits for a restart"}[
            self._engine_state]
        if placeholder != self.input.placeholderText():
            self.input.setPlaceholderText(placeholder)
            self.input.viewport().update()  # Qt repaints a changed placeholder only sometimes
        self.stop_button.setEnabled(busy)
        messages = view.conversation.messages if view is not None else []
        self.regenerate_button.setEnabled(not busy and self._engine_state != DEAD
                                          and bool(messages)
                                          and messages[-1].role == "assistant")
        self.refresh_labels()
