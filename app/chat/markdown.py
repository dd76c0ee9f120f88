"""Replies as rendered Markdown: prose through Qt's own Markdown reader (GitHub dialect:
headings, lists, tables, emphasis, links), fenced code as a monospace box with highlighting
and a Copy link.

Streaming: a reply is split at its last complete block (a blank line outside a code fence,
or a closing fence). What lies before it never changes again and is rendered once; only the
tail after it is removed and rendered anew on each batch of text. The finished reply is
rendered whole once more, so that lists and numbering split across batches come out as one.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtGui import (
    QColor,
    QFont,
    QFontDatabase,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFrameFormat,
)

from kvscope.app.chat.highlight import COLORS, spans

_HEADING = re.compile(r"^ {0,3}(#{1,6})\s")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)")
CODE_BACKGROUND = "#1b1e24"


@dataclass
class Segment:
    kind: str  # "prose" or "code"
    text: str
    lang: str = ""


def segments(text: str) -> list[Segment]:
    """Prose and fenced code, in order. An unclosed fence runs to the end (still streaming)."""
    out: list[Segment] = []
    prose: list[str] = []
    code: list[str] | None = None
    fence, lang = "", ""
    for line in text.split("\n"):
        if code is None:
            m = _FENCE.match(line)
            if m:
                if prose:
                    out.append(Segment("prose", "\n".join(prose)))
                    prose = []
                code, fence, lang = [], m.group(1), m.group(2)
            else:
                prose.append(line)
        elif line.strip().startswith(fence[0] * len(fence)) and \
                line.strip().strip(fence[0]) == "":
            out.append(Segment("code", "\n".join(code), lang))
            code = None
        else:
            code.append(line)
    if code is not None:
        out.append(Segment("code", "\n".join(code), lang))
    elif prose and any(p.strip() for p in prose):
        out.append(Segment("prose", "\n".join(prose)))
    return out


def stable_end(text: str, max_tail: int = 2000) -> int:
    """The length of the longest prefix made of complete blocks: it ends after a blank line
    outside a code fence or after a closing fence, and later text cannot change how it
    renders. A paragraph longer than max_tail is cut at its last line end outside a fence
    instead (it shows as two paragraphs until the finished reply is rendered whole), so
    that a reply without blank lines does not cost more on every batch."""
    end = line_end = 0
    pos = 0
    fence = ""
    for line in text.split("\n")[:-1]:  # the last piece has no newline yet: never complete
        pos += len(line) + 1
        if fence:
            if line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
                fence = ""
                end = line_end = pos
            continue
        m = _FENCE.match(line)
        if m:
            fence = m.group(1)
        else:
            line_end = pos
            if not line.strip():
                end = pos
    if len(text) - end > max_tail:
        end = max(end, line_end)
    return end


def monospace() -> QFont:
    font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    font.setStyleHint(QFont.StyleHint.Monospace)
    return font


class Renderer:
    """Renders Markdown at the end of one document. code_blocks receives each code block's
    text; its Copy link is "copy-code:<index in code_blocks>"."""

    def __init__(self, document: QTextDocument, code_blocks: list[str]) -> None:
        self.document = document
        self.code_blocks = code_blocks
        self.renders = 0  # how many times render() ran (tests count re-renders)
        self._mono = monospace()
        self._formats = {}
        for kind, color in COLORS.items():
            fmt = QTextCharFormat()
            fmt.setFont(self._mono)
            fmt.setForeground(QColor(color))
            self._formats[kind] = fmt

    def _end(self) -> QTextCursor:
        cursor = QTextCursor(self.document)
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def render(self, text: str, new_block: Callable[[], QTextCursor]) -> None:
        """text at the end of the document, each segment in a block of its own."""
        self.renders += 1
        edit = QTextCursor(self.document)
        edit.beginEditBlock()  # one layout of what changed, when it ends, not one per insert
        try:
            self._render(text, new_block)
        finally:
            edit.endEditBlock()

    def _render(self, text: str, new_block: Callable[[], QTextCursor]) -> None:
        for seg in segments(text):
            if seg.kind == "prose":
                cursor = new_block()
                start = cursor.position()
                prose = seg.text.strip("\n")
                cursor.insertMarkdown(prose, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
                heading = _HEADING.match(prose)
                if heading:  # the first block took the block's format it went into: restore
                    fmt = QTextBlockFormat()
                    fmt.setHeadingLevel(len(heading.group(1)))
                    fmt.setTopMargin(8)
                    fmt.setBottomMargin(4)
                    first = QTextCursor(self.document.findBlock(start))
                    first.setBlockFormat(fmt)
            else:
                self._code(seg, new_block())

    def _code(self, seg: Segment, cursor: QTextCursor) -> None:
        index = len(self.code_blocks)
        self.code_blocks.append(seg.text)
        frame = QTextFrameFormat()
        frame.setBackground(QColor(CODE_BACKGROUND))
        frame.setPadding(6)
        frame.setBorder(1)
        frame.setBorderBrush(QColor("#3a3f4b"))
        frame.setTopMargin(4)
        frame.setBottomMargin(4)
        cursor.insertFrame(frame)
        head = QTextCharFormat()
        head.setForeground(QColor("#8a8f98"))
        cursor.insertText(f"{seg.lang or 'code'}  ", head)
        link = QTextCharFormat()
        link.setAnchor(True)
        link.setAnchorHref(f"copy-code:{index}")
        link.setForeground(QColor("#8ab4f8"))
        cursor.insertText("Copy", link)
        # Lines wrap: unbroken lines would scroll the whole transcript sideways in a narrow dock.
        cursor.insertBlock(QTextBlockFormat(), self._formats["plain"])
        # Each piece inserted with its format, in order: one edit per piece, where inserting
        # the whole text and re-formatting each token after was two (and a token's re-format
        # re-lays out its block: most of a code block's cost while it streams).
        text, done = seg.text, 0
        for offset, length, kind in spans(text):
            if offset > done:
                cursor.insertText(text[done:offset], self._formats["plain"])
            cursor.insertText(text[offset:offset + length], self._formats[kind])
            done = offset + length
        if done < len(text):
            cursor.insertText(text[done:], self._formats["plain"])
