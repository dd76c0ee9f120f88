"""One trace's headline numbers: requests, tokens, throughput, TTFT/ITL percentiles, KV usage."""
from __future__ import annotations

import math
from typing import Any

import msgspec

from kvscope.ipc.trace_format import (
    Abort,
    Arrival,
    Chunk,
    Finish,
    Preempt,
    Reconfigure,
    Response,
    Step,
    Token,
    Trace,
)


class TraceSummary(msgspec.Struct):
    """Times in seconds or milliseconds as named; None where the trace has nothing to measure."""
    model: str
    block_size: int
    kv_dtype: str
    kv_rotation: str
    num_kv_blocks: int
    requests: int
    finished: int
    aborted: int
    steps: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    throughput_tok_s: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    preemptions: int
    reconfigures: int
    kv_usage_peak: float
    kv_usage_mean: float
    internal_waste_mean: float
    truncated: bool
    # Runs against an external server (trace replay --url): requests that failed (any HTTP
    # error), and the server's URL; 0 and None for kvscope's own traces.
    errors: int = 0
    server_url: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class TokenTimes(msgspec.Struct):
    ttft: list[float]  # seconds from arrival to the first token, per request
    itl: list[float]  # seconds between consecutive token events of a request
    output_tokens: int


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def token_times(trace: Trace) -> TokenTimes:
    arrival_t = {a.id: a.t for a in trace.of_type(Arrival)}
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    itl: list[float] = []
    output_tokens = 0
    for ev in trace.events:  # an external run's streamed chunks count as token events
        if not isinstance(ev, (Token, Chunk)):
            continue
        output_tokens += len(ev.tokens) if isinstance(ev, Token) else ev.tokens
        if ev.id in last_token:
            itl.append(ev.t - last_token[ev.id])
        else:
            first_token[ev.id] = ev.t
        last_token[ev.id] = ev.t
    ttft = [first_token[i] - arrival_t[i] for i in first_token if i in arrival_t]
    responses = trace.of_type(Response)
    if responses:  # the server's usage counts, not chunks (a chunk may hold several tokens)
        output_tokens = sum(r.completion_tokens or 0 for r in responses)
    return TokenTimes(ttft=ttft, itl=itl, output_tokens=output_tokens)


def duration(trace: Trace) -> float:
    """Seconds from the first arrival to the end of the last step or event."""
    start = min((a.t for a in trace.of_type(Arrival)), default=0.0)
    ends = [s.t + s.dur for s in trace.of_type(Step)] + [e.t for e in trace.events]
    return max(ends, default=start) - start


def internal_waste(trace: Trace) -> list[float]:
    """Per step, the share of the used blocks' slots that hold no token."""
    waste, block_size = [], trace.header.block_size
    for e in trace.events:  # the block size in force changes with a reconfigure
        if isinstance(e, Reconfigure):
            block_size = e.block_size
        elif isinstance(e, Step) and e.kv_used:
            waste.append(min(1.0, max(0.0, 1 - e.kv_tokens / (e.kv_used * block_size))))
    return waste


def summarize(trace: Trace) -> TraceSummary:
    h, arrivals, steps = trace.header, trace.of_type(Arrival), trace.of_type(Step)
    times = token_times(trace)
    seconds = duration(trace)
    usage = [s.kv_used / s.kv_total for s in steps if s.kv_total]
    return TraceSummary(
        model=h.model, block_size=h.block_size, kv_dtype=h.kv_dtype, kv_rotation=h.kv_rotation,
        num_kv_blocks=h.num_kv_blocks, requests=len(arrivals),
        finished=len(trace.of_type(Finish)), aborted=len(trace.of_type(Abort)),
        steps=len(steps), prompt_tokens=sum(a.prompt_len for a in arrivals),
        output_tokens=times.output_tokens, duration_s=seconds,
        throughput_tok_s=times.output_tokens / seconds if seconds > 0 else None,
        ttft_p50_ms=_ms(percentile(times.ttft, 50)), ttft_p90_ms=_ms(percentile(times.ttft, 90)),
        ttft_p99_ms=_ms(percentile(times.ttft, 99)), itl_p50_ms=_ms(percentile(times.itl, 50)),
        itl_p90_ms=_ms(percentile(times.itl, 90)), itl_p99_ms=_ms(percentile(times.itl, 99)),
        preemptions=len(trace.of_type(Preempt)), reconfigures=len(trace.of_type(Reconfigure)),
        kv_usage_peak=max(usage, default=0.0), kv_usage_mean=_mean(usage),
        internal_waste_mean=_mean(internal_waste(trace)), truncated=trace.truncated,
        errors=sum(r.error is not None for r in trace.of_type(Response)),
        server_url=h.server.url if h.server is not None else None)
