"""One conversation's transcript: user messages, replies rendered as Markdown, stats lines.

Only the reply in flight is ever re-rendered, and only its tail (app.chat.markdown): the
transcript above it is never touched while a reply streams. Clicking a reply (its header,
text or stats line) selects its request in the block map; the links in it do what they say
(copy a code block or the reply, edit a message of yours).
"""
from __future__ import annotations

import html

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QColor, QMouseEvent, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QTextBrowser, QWidget

from kvscope.app import colors
from kvscope.app.chat.conversation import Conversation, Message
from kvscope.app.chat.markdown import Renderer, stable_end
from kvscope.app.chat.turn import Turn

USER_COLOR = "#8ab4f8"
MUTED = "#8a8f98"


class ConversationView(QTextBrowser):
    requestClicked = Signal(str)
    actionClicked = Signal(str, int)  # "edit", "copy-reply" or "copy-code"; its index

    def __init__(self, index: int, conversation: Conversation,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.index = index
        self.conversation = conversation
        self.turn: Turn | None = None  # the reply in flight, if any
        self.saved = False  # its file exists (ChatPanel writes it with the first message)
        self.code_blocks: list[str] = []
        self.renderer = Renderer(self.document(), self.code_blocks)
        # (first, last position, request id) of each reply with a request: clicks select it.
        self.reply_ranges: list[tuple[int, int, str]] = []
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._anchor)
        self._plain = QTextCharFormat()
        self._plain.setForeground(QColor("#e6e6e6"))
        self._reply_start = self._body_start = self._tail_start = 0
        self._committed = 0
        self._reply_code = self._tail_code = 0
        # Following is a state, not a test made when text arrives: appending a header or a
        # line grows the range before the next check, so "at the bottom now" is already false
        # then. It changes only when the user scrolls (up: stop; back to the bottom: resume).
        self.following = True
        self._pinning = False
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._scrolled)
        bar.rangeChanged.connect(self._range_changed)
        self.render_all()

    @property
    def messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.conversation.messages]

    # -- document -----------------------------------------------------------------------------
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

    def _body_block(self) -> QTextCursor:
        return self._new_block(spacing=2)

    def _remove_from(self, position: int) -> None:
        cursor = self._end()
        if cursor.position() > position:
            cursor.setPosition(position, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()

    def render_all(self) -> None:
        """The whole transcript anew (at start, and after an edit or regenerate)."""
        self.clear()
        self.code_blocks.clear()
        self.reply_ranges.clear()
        for i, m in enumerate(self.conversation.messages):
            if m.role == "user":
                self._user_block(i, m.content)
            else:
                self._finished_reply(i, m)
        self.following = True
        self._pin_to_bottom()

    def _user_block(self, i: int, text: str) -> None:
        body = html.escape(text).replace("\n", "<br>")
        cursor = self._new_block()
        cursor.insertHtml(f"<b style='color:{USER_COLOR}'>You</b> "
                          f"<a href='edit:{i}' style='color:{MUTED};text-decoration:none;"
                          f"font-size:small'>✎ edit</a><br>{body}")
        cursor.setCharFormat(QTextCharFormat())  # what follows is not part of a link

    def _finished_reply(self, i: int, m: Message) -> None:
        self._new_block().insertHtml("<b style='color:#c8ccd4'>■ Assistant</b>")
        self.renderer.render(m.content, self._body_block)
        self._stats_line(i, m.stats, m.error, None)

    def _stats_line(self, i: int, stats: str, error: str, request_id: str | None) -> None:
        color = "#e06c75" if error else MUTED
        note = f"⚠ {html.escape(error)}<br>" if error else ""
        text = f"<span style='color:{color};font-size:small'>{note}{html.escape(stats)}</span>"
        if request_id:
            text = f"<a href='request:{request_id}' style='text-decoration:none'>{text}</a>"
        self._new_block(spacing=2).insertHtml(
            f"{text} <a href='copy-reply:{i}' style='color:{MUTED};text-decoration:none;"
            f"font-size:small'>· copy reply</a>")
        self._end().setCharFormat(QTextCharFormat())

    # -- the reply in flight ------------------------------------------------------------------
    def append_user(self, text: str) -> None:
        """Show the user's message (already the conversation's last)."""
        self._user_block(len(self.conversation.messages) - 1, text)
        self.following = True  # the user's own message: show it and what answers it
        self._pin_to_bottom()

    def begin_reply(self, turn: Turn) -> None:
        self.turn = turn
        rgb = colors.hex_color(colors.request_rgb(turn.request_id))
        self._reply_start = self._end().position()
        cursor = self._new_block()
        cursor.insertHtml(
            f"<a href='request:{turn.request_id}' style='color:{rgb};text-decoration:none'>"
            f"<b>■ Assistant</b> <span style='color:{MUTED}'>"
            f"({html.escape(turn.request_id)})</span></a>")
        self._end().setCharFormat(QTextCharFormat())
        self._body_start = self._tail_start = self._end().position()
        self._committed = 0
        self._reply_code = self._tail_code = len(self.code_blocks)
        self.reply_ranges.append((self._reply_start, self._body_start, turn.request_id))
        self._keep_following()

    def update_reply(self, text: str) -> None:
        """The reply's text so far: render what became complete once, then the tail anew."""
        end = stable_end(text)
        bar = self.verticalScrollBar()
        held = bar.value()
        # Removing the tail shrinks the range for a moment: that is no scroll of the user's.
        self._pinning = True
        try:
            self._remove_from(self._tail_start)
            del self.code_blocks[self._tail_code:]
            if end > self._committed:
                self.renderer.render(text[self._committed:end], self._body_block)
                self._committed = end
                self._tail_start = self._end().position()
                self._tail_code = len(self.code_blocks)
            if text[self._committed:].strip():
                self.renderer.render(text[self._committed:], self._body_block)
        finally:
            self._pinning = False
        self._set_range_end()
        if self.following:
            self._pin_to_bottom()
        else:
            bar.setValue(held)

    def end_reply(self, turn: Turn, message_index: int) -> None:
        """The reply whole, rendered once more as one text, then its stats line."""
        bar = self.verticalScrollBar()
        held = bar.value()
        self._pinning = True
        try:
            self._remove_from(self._body_start)
            del self.code_blocks[self._reply_code:]
            self.renderer.render(turn.text, self._body_block)
            self._stats_line(message_index, turn.stats_text(), turn.error or "",
                             turn.request_id)
        finally:
            self._pinning = False
        self._set_range_end()
        self.turn = None
        if self.following:
            self._pin_to_bottom()
        else:
            bar.setValue(held)

    def _set_range_end(self) -> None:
        if self.reply_ranges:
            start, _, rid = self.reply_ranges[-1]
            self.reply_ranges[-1] = (start, self._end().position(), rid)

    # -- following the end --------------------------------------------------------------------
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

    # -- clicks ---------------------------------------------------------------------------------
    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        super().mouseReleaseEvent(event)
        if event.button() != Qt.MouseButton.LeftButton or self.textCursor().hasSelection() \
                or self.anchorAt(event.position().toPoint()):
            return
        position = self.cursorForPosition(event.position().toPoint()).position()
        for start, end, rid in self.reply_ranges:
            if start < position <= end:
                self.requestClicked.emit(rid)
                return

    def _anchor(self, url: QUrl) -> None:
        text = url.toString()
        kind, _, rest = text.partition(":")
        if kind == "request":
            self.requestClicked.emit(rest)
        elif kind in ("edit", "copy-reply", "copy-code") and rest.isdigit():
            self.actionClicked.emit(kind, int(rest))
