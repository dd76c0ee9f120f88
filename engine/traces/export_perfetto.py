"""A trace as Chrome trace-event JSON (ui.perfetto.dev): engine steps and counters on one
track, each request's queued/prefill/decode/preempted spans on another."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvscope.ipc.trace_format import Abort, Arrival, Finish, Preempt, Step, Token, Trace

ENGINE_PID, REQUESTS_PID = 1, 2


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


class _RequestSpans:
    """Each request is one async span (its id) with its current state nested inside it."""

    def __init__(self, out: list[dict[str, Any]]) -> None:
        self.out = out
        self.state: dict[str, str] = {}

    def _edge(self, ph: str, name: str, rid: str, t: float,
              args: dict[str, Any] | None = None) -> None:
        ev = {"ph": ph, "cat": "request", "name": name, "id": rid, "pid": REQUESTS_PID,
              "tid": 0, "ts": _us(t)}
        self.out.append({**ev, "args": args} if args is not None else ev)

    def arrive(self, rid: str, t: float, prompt_len: int) -> None:
        self._edge("b", rid, rid, t, {"prompt_len": prompt_len})
        self.enter(rid, "queued", t)

    def enter(self, rid: str, new: str | None, t: float) -> None:
        """Close the current state's span; open `new`, or end the request when it is None."""
        old = self.state.pop(rid, None)
        if old is not None:
            self._edge("e", old, rid, t)
        if new is None:
            self._edge("e", rid, rid, t)
        else:
            self._edge("b", new, rid, t)
            self.state[rid] = new

    def close_all(self, t: float) -> None:
        for rid in list(self.state):
            self.enter(rid, None, t)


def _step_events(e: Step, kv_total: int) -> list[dict[str, Any]]:
    ts = _us(e.t)
    return [
        {"ph": "X", "name": "step", "cat": "engine", "pid": ENGINE_PID, "tid": 1, "ts": ts,
         "dur": max(1, _us(e.dur)),
         "args": {"batch_size": e.batch_size, "tokens": e.tokens, "budget": e.budget}},
        {"ph": "C", "name": "batch_size", "pid": ENGINE_PID, "ts": ts,
         "args": {"batch_size": e.batch_size}},
        {"ph": "C", "name": "tokens_per_step", "pid": ENGINE_PID, "ts": ts,
         "args": {"tokens": e.tokens}},
        {"ph": "C", "name": "kv_usage", "pid": ENGINE_PID, "ts": ts,
         "args": {"used_blocks": e.kv_used, "usage": e.kv_used / (e.kv_total or kv_total or 1)}},
    ]


def _process_names() -> list[dict[str, Any]]:
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
            for pid, name in ((ENGINE_PID, "engine"), (REQUESTS_PID, "requests"))]


def to_chrome(trace: Trace) -> dict[str, Any]:
    """Chrome trace-event JSON: pid 1 is the engine (steps, counters), pid 2 the requests."""
    ev = _process_names()
    spans = _RequestSpans(ev)
    kv_total = trace.header.num_kv_blocks
    for e in trace.events:
        if isinstance(e, Arrival):
            spans.arrive(e.id, e.t, e.prompt_len)
        elif isinstance(e, Step):
            ev += _step_events(e, kv_total)
            for rid, _ in e.seqs:
                if spans.state.get(rid) in ("queued", "preempted"):
                    spans.enter(rid, "prefill", e.t)
        elif isinstance(e, Token):
            if spans.state.get(e.id) == "prefill":
                spans.enter(e.id, "decode", e.t)
        elif isinstance(e, Preempt):
            ev.append({"ph": "i", "name": "preempt", "cat": "engine", "pid": ENGINE_PID,
                       "tid": 1, "s": "p", "ts": _us(e.t), "args": {"request": e.id}})
            if e.id in spans.state:
                spans.enter(e.id, "preempted", e.t)
        elif isinstance(e, (Finish, Abort)) and e.id in spans.state:
            spans.enter(e.id, None, e.t)
    end = max((x["ts"] + x.get("dur", 0) for x in ev if "ts" in x), default=0)
    spans.close_all(end / 1_000_000)  # a trace cut short: close what is still open
    ev.sort(key=lambda x: x.get("ts", -1))  # stable: per-track order is kept
    h = trace.header
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "metadata": {"kvscope_model": h.model, "block_size": h.block_size,
                         "kv_dtype": h.kv_dtype, "kv_rotation": h.kv_rotation,
                         "wall_time": h.wall_time}}


def write_chrome(trace: Trace, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(to_chrome(trace)))
