"""The session trace file format (JSONL), shared by the engine that writes it and the window.

One header line, then one event per line; every line is a msgspec Struct tagged by its "ev"
field. Times `t` are seconds since the header's clock anchor (`monotonic`); `wall_time` is the
same instant on the wall clock. The writer appends and flushes line by line, so a killed writer
leaves at most its last line cut off: the reader tolerates exactly that and nothing else. A trace
file is untrusted input: lines are decoded strictly by msgspec (never evaluated), and a bad line
is an error naming its line number.

Imports neither torch nor Qt: the engine and the app both use this module.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 1

# The engine config as a plain dict of scalars (engine.config.EngineConfig.to_dict()).
ConfigDict = dict[str, str | int | float | bool | None]


class TraceError(ValueError):
    """A trace file that does not validate; the message names the line and the reason."""


class _Line(msgspec.Struct, tag_field="ev", forbid_unknown_fields=True, omit_defaults=True):
    pass


class ServerInfo(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The external OpenAI-compatible server a run was replayed against (trace replay --url).
    models / version: the server's own /v1/models and /version answers, as it gave them
    (None where it has none)."""
    url: str
    api: str  # "completions" or "chat"
    model: str  # the model name the requests asked for
    models: Any = None
    version: Any = None


class Header(_Line, tag="header"):
    schema_version: int
    kvscope_version: str
    model: str
    device: str
    dtype: str
    kv_dtype: str
    block_size: int
    num_kv_blocks: int
    config: ConfigDict
    wall_time: float
    monotonic: float
    include_prompts: bool
    kv_rotation: str = "none"  # resolved: "calibrated", "hadamard" or "none" (older traces: "none")
    # Set when the run was against an external server: device, dtype and the KV fields then
    # say "external"/0, as kvscope cannot see them.
    server: ServerInfo | None = None


class Arrival(_Line, tag="arrival"):
    t: float
    id: str
    prompt_len: int
    sampling: dict[str, int | float | bool | str | None | list[int | str]]
    prompt: list[int] | None = None

    @property
    def priority(self) -> object:
        """The request's priority (lower = sooner) as recorded with its sampling; 0 in traces
        from before priorities. Not checked here: replay hands it to SamplingParams, which
        refuses a bad one by name."""
        return self.sampling.get("priority", 0)


class Step(_Line, tag="step"):
    t: float
    dur: float
    # [request id, tokens scheduled] per scheduled request
    seqs: list[tuple[str, int]]
    batch_size: int
    tokens: int
    budget: int
    kv_used: int
    kv_total: int
    kv_tokens: int
    running: int
    waiting: int
    # [request id, drafted tokens, accepted ones] per speculative verify (issue 31)
    spec: list[tuple[str, int, int]] = []


class Alloc(_Line, tag="alloc"):
    t: float
    id: str
    blocks: list[int]


class Free(_Line, tag="free"):
    t: float
    id: str
    blocks: list[int]


class Preempt(_Line, tag="preempt"):
    t: float
    id: str
    # "memory" (the pool ran dry) or "priority" (a more urgent request took its place);
    # "" in traces from before the scheduler said why.
    reason: str = ""


class Token(_Line, tag="token"):
    t: float
    id: str
    tokens: list[int]


class Finish(_Line, tag="finish"):
    t: float
    id: str
    reason: str


class Abort(_Line, tag="abort"):
    t: float
    id: str


class Chunk(_Line, tag="chunk"):
    """A streamed piece of an external server's reply, when it arrived: text, not token ids
    (an OpenAI stream carries text). tokens: how many tokens it holds where known, else 1."""
    t: float
    id: str
    text: str
    tokens: int = 1


class Response(_Line, tag="response"):
    """How one request to an external server ended. t: when (the last byte, or the error);
    status: its HTTP status (0: no answer). ttft/e2e in seconds from the send; the token
    counts are the server's `usage` when usage_from is "server", else counted from chunks."""
    t: float
    id: str
    status: int
    e2e: float
    ttft: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_from: str = "server"  # "server" or "chunks"
    error: str | None = None
    attempts: int = 1


class Reconfigure(_Line, tag="reconfigure"):
    """The pool was rebuilt under a new config; live requests start over (recompute)."""
    t: float
    config: ConfigDict
    kv_dtype: str
    block_size: int
    num_kv_blocks: int
    kv_rotation: str = "none"


class Offload(_Line, tag="offload"):
    """Cached blocks the pool evicted were copied to a KV tier (issue 56) during the step at t.
    medium: vLLM's name of the tier ("CPU" host memory, "STORAGE" disk)."""
    t: float
    blocks: int
    medium: str


class Onboard(_Line, tag="onboard"):
    """A request's prefix blocks were copied back from a KV tier instead of computed."""
    t: float
    id: str
    blocks: int
    medium: str


Event = (Arrival | Step | Alloc | Free | Preempt | Token | Finish | Abort | Reconfigure | Chunk
         | Response | Offload | Onboard)
EVENT_TYPES = (Arrival, Step, Alloc, Free, Preempt, Token, Finish, Abort, Reconfigure, Chunk,
               Response, Offload, Onboard)
Line = Header | Event

E = TypeVar("E")


@dataclass
class Trace:
    """A parsed trace: the header, the events in file order, and where it was cut off."""
    header: Header
    events: list[Event] = field(default_factory=list)
    # The line number of a cut-off last line (a killed writer) that was dropped, else None.
    cut_line: int | None = None

    @property
    def truncated(self) -> bool:
        return self.cut_line is not None

    def of_type(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]


# -- writing -------------------------------------------------------------------------------
class TraceWriter:
    """Writes a new trace file: the header first, then events, each line flushed at once."""

    def __init__(self, path: str | os.PathLike[str], header: Header) -> None:
        self.path = Path(path)
        self._enc = msgspec.json.Encoder()
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self.write([header])

    def write(self, lines: Iterable[Line]) -> None:
        """Append lines in one write, so a crash cuts at most the last line written."""
        data = b"".join(self._enc.encode(line) + b"\n" for line in lines)
        if data:
            self._file.write(data)
            self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


# -- reading -------------------------------------------------------------------------------
_header_decoder = msgspec.json.Decoder(Header)
_event_decoder = msgspec.json.Decoder(Event)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Parse a kvscope trace file strictly. A cut-off last line is tolerated, nothing else."""
    return parse_trace(Path(path).read_bytes(), str(path))


def parse_trace(data: bytes, name: str = "<trace>") -> Trace:
    """Parse trace bytes; `name` prefixes every error message (as in "name:LINE: reason")."""
    lines = data.split(b"\n")
    complete_end = data.endswith(b"\n")
    if complete_end:
        lines.pop()
    if not lines or not lines[0].strip():
        raise TraceError(f"{name}:1: empty file or missing header line")
    header = _read_header(name, lines[0], is_last=len(lines) == 1 and not complete_end)
    trace = Trace(header)
    for n, raw in enumerate(lines[1:], start=2):
        try:
            trace.events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError as exc:
            if n == len(lines) and not complete_end and is_cut_json(raw):
                trace.cut_line = n
                break
            raise TraceError(_line_error(name, n, exc)) from None
    return trace


def _line_error(name: str, n: int, exc: msgspec.DecodeError) -> str:
    # ValidationError is a DecodeError: JSON of the wrong shape, rather than no JSON at all.
    if isinstance(exc, msgspec.ValidationError):
        return f"{name}:{n}: {exc}"
    return f"{name}:{n}: not JSON: {exc}"


def is_cut_json(raw: bytes) -> bool:
    """Whether a line reads as the beginning of a JSON value that was cut off."""
    text = _utf8_cut_tolerant(raw)
    if text is None:
        return False
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(text.rstrip()) or "Unterminated" in exc.msg
    return False


def _utf8_cut_tolerant(raw: bytes) -> str | None:
    """The line as text, dropping a multi-byte character cut at its very end; None if the
    bytes are not UTF-8 anywhere else."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and exc.end == len(raw):
            return raw[:exc.start].decode("utf-8")
        return None


def _read_header(name: str, raw: bytes, is_last: bool) -> Header:
    try:
        generic = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        if is_last and is_cut_json(raw):
            raise TraceError(f"{name}:1: the header line is cut off (empty trace)") from None
        raise TraceError(f"{name}:1: not JSON: {exc}") from None
    if not isinstance(generic, dict) or generic.get("ev") != "header":
        raise TraceError(f"{name}:1: expected a kvscope trace header "
                         f'({{"ev": "header", ...}}), got {str(generic)[:80]}')
    version = generic.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TraceError(f"{name}:1: unsupported schema_version {version!r} "
                         f"(this kvscope reads version {SCHEMA_VERSION})")
    try:
        return _header_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{name}:1: {exc}") from None
