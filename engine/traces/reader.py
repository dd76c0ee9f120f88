"""Read a kvscope trace back, strictly: a trace file is untrusted input."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvscope.engine.traces.schema import SCHEMA_VERSION, Arrival, Event, Header, Token, TraceError


@dataclass
class Trace:
    header: Header
    events: list = field(default_factory=list)
    truncated: bool = False  # the last line was cut off (a killed writer) and was dropped

    def of_type(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


_header_decoder = msgspec.json.Decoder(Header)
_event_decoder = msgspec.json.Decoder(Event)


def read_trace(path: str | os.PathLike) -> Trace:
    """Parse a kvscope trace strictly. A cut-off last line is tolerated, nothing else."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    complete_end = data.endswith(b"\n")
    if complete_end:
        lines.pop()
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}:1: empty file or missing header line")
    header = _read_header(path, lines[0], is_last=len(lines) == 1 and not complete_end)
    trace = Trace(header)
    for n, raw in enumerate(lines[1:], start=2):
        is_last = n == len(lines)
        try:
            trace.events.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if is_last and not complete_end and _is_cut_json(raw):
                trace.truncated = True
                break
            raise TraceError(f"{path}:{n}: {exc}") from None
    return trace


def _is_cut_json(raw: bytes) -> bool:
    """Whether a line reads as the beginning of a JSON value that was cut off."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(raw.rstrip()) or "Unterminated" in exc.msg
    return False


def _read_header(path, raw: bytes, is_last: bool) -> Header:
    try:
        generic = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        if is_last and _is_cut_json(raw):
            raise TraceError(f"{path}:1: the header line is cut off (empty trace)") from None
        raise TraceError(f"{path}:1: not JSON: {exc}") from None
    if not isinstance(generic, dict) or generic.get("ev") != "header":
        raise TraceError(f"{path}:1: expected a kvscope trace header "
                         f'({{"ev": "header", ...}}), got {str(generic)[:80]}')
    version = generic.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TraceError(f"{path}:1: unsupported schema_version {version!r} "
                         f"(this kvscope reads version {SCHEMA_VERSION})")
    try:
        return _header_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}:1: {exc}") from None


def outputs_of(trace: Trace) -> dict[str, list[int]]:
    """Each request's emitted token ids, in arrival order."""
    out = {a.id: [] for a in trace.of_type(Arrival)}
    for ev in trace.of_type(Token):
        out.setdefault(ev.id, []).extend(ev.tokens)
    return out
