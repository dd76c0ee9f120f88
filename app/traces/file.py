"""The per-step series the window plots from a session trace: batch tokens and KV usage.

The file is read by kvscope.ipc.trace_format, the same strict reader the engine uses (a bad
line is a TraceError naming its line number; only a cut-off last line is tolerated)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvscope.ipc.trace_format import Header, Step, Trace, read_trace


@dataclass
class TraceSeries:
    header: Header
    t: list[float] = field(default_factory=list)  # seconds since the first event
    tokens: list[int] = field(default_factory=list)  # batch tokens per step
    kv_usage: list[float] = field(default_factory=list)  # kv_used / kv_total, 0..1
    events: int = 0
    cut_line: int | None = None  # the cut-off last line that was dropped, if any

    @property
    def truncated(self) -> bool:
        return self.cut_line is not None


def series_of(trace: Trace) -> TraceSeries:
    out = TraceSeries(header=trace.header, events=len(trace.events), cut_line=trace.cut_line)
    t_first = min((e.t for e in trace.events), default=0.0)
    for s in trace.of_type(Step):
        out.t.append(s.t - t_first)
        out.tokens.append(s.tokens)
        out.kv_usage.append(s.kv_used / s.kv_total if s.kv_total > 0 else 0.0)
    return out


def read_series(path: str | os.PathLike[str]) -> TraceSeries:
    """Raises kvscope.ipc.trace_format.TraceError (or OSError) for a file it cannot use."""
    return series_of(read_trace(path))
