"""Every run as the same per-request records, whatever file it came from: a kvscope trace
(token events, finish/abort), a replay against an external server (streamed chunks and a
response line per request), or a Mooncake-style workload (arrivals and lengths, no timings).

Times are seconds; `arrival` counts from the run's first arrival. TTFT is from the send to
the first token (chunk), E2E from the send to the end, ITL the gaps between a request's token
events, TPOT (E2E - TTFT) / (output tokens - 1) as `vllm bench serve` defines it.
"""
from __future__ import annotations

import os

import msgspec

from kvscope.engine.traces.workload import is_mooncake, read_mooncake
from kvscope.ipc.trace_format import (
    Abort,
    Arrival,
    Chunk,
    Finish,
    Response,
    Token,
    Trace,
    read_trace,
)


class RequestRecord(msgspec.Struct):
    id: str
    arrival: float
    prompt_len: int
    output_tokens: int
    ok: bool  # it ended normally (finished; for an external run: no error)
    greedy: bool
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None  # what an external server streamed
    token_ids: list[int] | None = None  # what kvscope's engine emitted

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float:
        return self.arrival + (self.e2e or 0.0)


class Run(msgspec.Struct):
    name: str
    kind: str  # "kvscope", "external" or "workload"
    model: str
    server_url: str | None
    requests: dict[str, RequestRecord]  # by id, in arrival order
    has_timings: bool


def load_run(path: str | os.PathLike[str]) -> Run:
    """TraceError (or OSError) for a file that is neither a trace nor a workload."""
    if is_mooncake(path):
        return _workload_run(str(path))
    return run_of_trace(read_trace(path), str(path))


def _workload_run(name: str) -> Run:
    reqs = {w.request_id: RequestRecord(id=w.request_id, arrival=w.t, prompt_len=w.prompt_len,
                                        output_tokens=w.max_tokens, ok=True, greedy=True)
            for w in read_mooncake(name)}
    return Run(name=name, kind="workload", model="", server_url=None, requests=reqs,
               has_timings=False)


def _is_greedy(a: Arrival) -> bool:
    try:
        return float(a.sampling.get("temperature", 0.0) or 0.0) == 0.0  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


class _Times:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.ids: list[int] = []
        self.text: list[str] = []
        self.count = 0


def run_of_trace(trace: Trace, name: str) -> Run:
    arrivals = trace.of_type(Arrival)
    t0 = min((a.t for a in arrivals), default=0.0)
    seen: dict[str, _Times] = {a.id: _Times() for a in arrivals}
    ends: dict[str, tuple[float, str | None, str | None]] = {}  # t, finish reason, error
    responses: dict[str, Response] = {}
    for ev in trace.events:
        if isinstance(ev, (Token, Chunk)) and ev.id in seen:
            got = seen[ev.id]
            got.times.append(ev.t)
            if isinstance(ev, Token):
                got.ids += ev.tokens
                got.count += len(ev.tokens)
            else:
                got.text.append(ev.text)
                got.count += ev.tokens
        elif isinstance(ev, Finish):
            ends.setdefault(ev.id, (ev.t, ev.reason, None))
        elif isinstance(ev, Abort):
            ends.setdefault(ev.id, (ev.t, None, "aborted"))
        elif isinstance(ev, Response):
            responses[ev.id] = ev
    external = trace.header.server is not None
    reqs = {a.id: _record(a, t0, seen[a.id], ends.get(a.id), responses.get(a.id), external)
            for a in arrivals}
    return Run(name=name, kind="external" if external else "kvscope", model=trace.header.model,
               server_url=trace.header.server.url if trace.header.server else None,
               requests=reqs, has_timings=True)


def _record(a: Arrival, t0: float, got: _Times,
            end: tuple[float, str | None, str | None] | None, resp: Response | None,
            external: bool) -> RequestRecord:
    itl = [b - x for x, b in zip(got.times, got.times[1:], strict=False)]
    rec = RequestRecord(id=a.id, arrival=a.t - t0, prompt_len=a.prompt_len,
                        output_tokens=got.count, ok=False, greedy=_is_greedy(a), itl=itl,
                        ttft=got.times[0] - a.t if got.times else None)
    if external:
        rec.text = "".join(got.text)
        if resp is not None:
            rec.ok, rec.error, rec.finish_reason = resp.error is None, resp.error, \
                resp.finish_reason
            rec.e2e, rec.ttft = resp.e2e, resp.ttft
            rec.output_tokens = resp.completion_tokens or 0
        else:
            rec.error = "no response line (the run was cut off)"
        return rec
    rec.token_ids = got.ids
    if end is None:
        rec.error = "did not finish (the trace ends first)"
    else:
        rec.e2e, rec.finish_reason, rec.error = end[0] - a.t, end[1], end[2]
        rec.ok = end[2] is None
    return rec
