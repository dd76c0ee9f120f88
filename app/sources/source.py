"""The source interface: what an engine the window watches can tell it, and how.

Every engine the window shows is a source: kvscope's own (ZeroMQ, app.sources.kvscope_source),
a vLLM server and llama.cpp's `llama-server` (HTTP, polled on a worker thread). A source says
what it can report in `capabilities`; the views draw what is there and say in place what is
not ("not reported by llama-server"), never a zero. The views import this module only, never
a source module (an import contract in pyproject.toml enforces it).

Threads: a polled source's worker thread only puts plain data into its SourceMailbox; the
window takes the newest state on the GUI thread (app.bridge.SourceBridge). Nothing here
touches Qt.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

# -- capabilities: what a source can report -------------------------------------------------
BLOCK_TABLE = "block table"  # physical blocks per request
KV_BYTES = "KV bytes"  # bytes of KV memory, per token and in all
KV_USAGE = "KV usage"  # share of the KV pool in use
PREFIX_CACHE = "prefix cache"  # which content hashes are cached (KV events)
SLOTS = "slots"  # per-slot context fill (llama-server)
STEPS = "batch per step"  # prefill/decode tokens of each engine step
QUEUES = "queues"  # running / waiting requests
THROUGHPUT = "throughput"  # prompt / generation tokens per second
LATENCY = "latency"  # TTFT / ITL percentiles
PREEMPTIONS = "preemptions"
DEVICE = "device memory"
CHAT = "chat"
RECONFIGURE = "live settings"  # block size, KV dtype, ... changed while it runs
TRACES = "traces"
SETTINGS = "settings"  # the settings in force, read-only

ALL = frozenset({BLOCK_TABLE, KV_BYTES, KV_USAGE, PREFIX_CACHE, STEPS, QUEUES, THROUGHPUT,
                 LATENCY, PREEMPTIONS, DEVICE, CHAT, RECONFIGURE, TRACES, SETTINGS})
KINDS = ("kvscope", "vllm", "llama-server")


def not_reported(kind: str, what: str = "") -> str:
    """The in-place text of a view whose data the source lacks."""
    return f"{what + ': ' if what else ''}not reported by {kind}"


# -- what the views draw --------------------------------------------------------------------
@dataclass(frozen=True)
class SlotState:
    """One llama-server slot: its context and how much of it the slot's task fills."""
    id: int
    n_ctx: int  # context size of this slot
    n_used: int | None  # tokens in its KV (prompt + generated); None: not reported
    task: int | None  # the task it serves (or served last); None: never used
    processing: bool
    n_decoded: int | None = None
    n_remain: int | None = None


@dataclass(frozen=True)
class SlotsFrame:
    time: float
    slots: tuple[SlotState, ...]
    disabled: str | None = None  # why /slots gave nothing (with how to enable it)


@dataclass(frozen=True)
class SourceCounts:
    """The source's stream as the window saw it (app.bridge.StreamCounts' fields, plus bad):
    received: items the worker posted (a state value or a plot step); shown: taken by the
    window; coalesced: replaced by a newer one before the window took it; lost: known gaps
    (KV-event sequence numbers); bad: malformed payloads (/metrics, /slots, KV events),
    counted and skipped."""
    received: int
    shown: int
    coalesced: int
    lost: int
    bad: int


@dataclass
class SourceUpdate:
    """What changed since the window last took: plot frames in order, the rest newest only."""
    samples: list = field(default_factory=list)  # source-specific samples (vLLM: ServerSample)
    steps: list = field(default_factory=list)  # app.plots frames (duck-typed, see plot_frames)
    kv: list = field(default_factory=list)
    stats: list = field(default_factory=list)
    cache: object | None = None  # a prefix-cache snapshot (vLLM), newest
    events: object | None = None  # KV-event subscriber counters, newest
    slots: SlotsFrame | None = None  # llama-server's slots, newest
    settings: dict[str, str] | None = None  # read-only settings, newest
    facts: str | None = None  # one line for the header: model, queues, ...
    notice: str | None = None  # what the server leaves out and how to turn it on ("": none)
    error: str | None = None  # the server cannot be reached (DEAD); None once it answers
    bad: str | None = None  # the newest malformed payload, named
    scraped_ok: bool = False


MAX_FRAMES = 600  # plot frames kept for a window that does not take (minimised, stalled)


class SourceMailbox:
    """Hand-over from a worker thread: plot frames appended (bounded), state newest-wins."""

    STATE = ("cache", "events", "slots", "settings", "facts", "notice")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._update = SourceUpdate()
        self.received = self.shown = self.coalesced = self.lost = self.bad = 0

    def post(self, **changes) -> None:
        """Worker thread: record new state (any SourceUpdate field)."""
        with self._lock:
            u = self._update
            # One item per state value and per plot step: received = shown + coalesced +
            # waiting for the next take.
            self.received += sum(n in self.STATE for n in changes) + len(changes.get("steps", ()))
            for name, value in changes.items():
                if name in ("samples", "steps", "kv", "stats"):
                    items = getattr(u, name)
                    items.extend(value)
                    if len(items) > MAX_FRAMES:
                        if name == "steps":
                            self.coalesced += len(items) - MAX_FRAMES
                        del items[:len(items) - MAX_FRAMES]
                    continue
                if name in self.STATE and getattr(u, name) is not None:
                    self.coalesced += 1  # the window never saw the older one
                setattr(u, name, value)

    def count_bad(self, what: str) -> None:
        with self._lock:
            self.bad += 1
            self._update.bad = what

    def set_lost(self, lost: int) -> None:
        with self._lock:
            self.lost = lost

    def take(self) -> SourceUpdate:
        """GUI thread: everything since the last take; error stays until it is cleared."""
        with self._lock:
            update = self._update
            self._update = SourceUpdate(error=update.error)
            self.shown += sum(getattr(update, n) is not None for n in self.STATE) \
                + len(update.steps)
        return update

    def counts(self) -> SourceCounts:
        with self._lock:
            return SourceCounts(self.received, self.shown, self.coalesced, self.lost, self.bad)


class ChatError(Exception):
    pass


class Source:
    """An engine the window watches. `kind` is one of KINDS; `url` where it is."""

    kind: str = ""
    capabilities: frozenset[str] = frozenset()

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def label(self) -> str:
        return f"{self.kind} at {self.url}"

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def missing(self, what: str = "") -> str:
        return not_reported(self.kind, what)

    def known(self) -> str:
        """A sentence for the header: what this engine reports and what it does not."""
        return ""

    def settings_rows(self) -> list[tuple[str, str, str]]:
        """(key, title, why it is read-only) of the settings shown for an engine the window
        cannot change (SourceUpdate.settings gives their values)."""
        return []

    def read_only_reason(self) -> str:
        """Why the window cannot change this engine's settings ("" when it can)."""
        return "" if self.has(RECONFIGURE) else \
            f"{self.kind} fixes its settings when it starts; restart it to change them"


class PolledSource(Source, ABC):
    """A source whose worker thread polls the engine and posts into `mailbox`."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.mailbox = SourceMailbox()

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    def take(self) -> SourceUpdate:
        return self.mailbox.take()

    def counts(self) -> SourceCounts:
        return self.mailbox.counts()

    def stream_chat(self, messages: list[dict], sampling: dict) -> Iterator[str]:
        """Worker thread: the reply's text pieces (ChatError says what failed)."""
        raise ChatError(self.missing("chat"))
