"""Server-sent events (the WHATWG event-stream format) parsed incrementally from raw bytes.

Only what an OpenAI stream uses: `data:` lines joined by newlines, dispatched at a blank line;
comments (`:`) and the other fields (event, id, retry) are skipped. The bytes come from a
server we do not control: an event over MAX_EVENT_BYTES or text that is not UTF-8 is an
SseError, never a crash or an unbounded buffer.
"""
from __future__ import annotations

MAX_EVENT_BYTES = 4 * 1024 * 1024


class SseError(ValueError):
    """The stream is not a well-formed event stream."""


class SseParser:
    """feed(bytes) returns the events (their data, as text) completed by those bytes."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._size = 0

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        events: list[str] = []
        while (line := self._next_line()) is not None:
            self._take(line, events)
        if len(self._buf) + self._size > MAX_EVENT_BYTES:
            raise SseError(f"an event of more than {MAX_EVENT_BYTES} bytes")
        return events

    def _next_line(self) -> bytes | None:
        """The next complete line (CRLF, LF or CR ended), None if there is none yet. A CR at
        the very end may be half a CRLF: wait for the next byte."""
        buf = self._buf
        lf, cr = buf.find(b"\n"), buf.find(b"\r")
        i = lf if cr == -1 or (lf != -1 and lf < cr) else cr
        if i == -1:
            return None
        end = i + 1
        if buf[i] == 0x0D:
            if i + 1 == len(buf):
                return None
            end += buf[i + 1] == 0x0A
        line, self._buf = buf[:i], buf[end:]
        return line

    def _take(self, raw: bytes, events: list[str]) -> None:
        if not raw:  # a blank line ends the event
            if self._data:
                events.append("\n".join(self._data))
            self._data, self._size = [], 0
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SseError(f"a line that is not UTF-8: {exc}") from None
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            value = value.removeprefix(" ")
            self._data.append(value)
            self._size += len(raw)

    def pending(self) -> bool:
        """Whether an event was begun but not ended (the stream stopped mid-event)."""
        return bool(self._data or self._buf.strip())
