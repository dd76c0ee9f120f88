"""Read a kvscope session trace (JSONL) for the app: the header and the per-step series.

A trace file is untrusted input: every line is decoded as JSON (never evaluated), the fields
the app uses are type-checked, and a bad line is reported with its line number. A cut-off
last line (a trace still being written, or a crash) is tolerated and marked `truncated`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

SCHEMA_VERSION = 1
EVENTS = {"arrival", "step", "alloc", "free", "preempt", "token", "finish", "abort",
          "reconfigure"}
STEP_INTS = ("tokens", "kv_used", "kv_total", "batch_size", "budget")


class TraceFileError(ValueError):
    pass


@dataclass
class TraceSeries:
    header: dict
    t: list[float] = field(default_factory=list)  # seconds since the first event
    tokens: list[int] = field(default_factory=list)  # batch tokens per step
    kv_usage: list[float] = field(default_factory=list)  # kv_used / kv_total, 0..1
    events: int = 0
    truncated: bool = False


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cut_off(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(raw.rstrip()) or "Unterminated" in exc.msg
    except UnicodeDecodeError:
        return False
    return False


def read_series(path: str | Path) -> TraceSeries:
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    complete = data.endswith(b"\n")
    if complete:
        lines.pop()
    if not lines or not lines[0].strip():
        raise TraceFileError(f"{path}:1: empty file or missing header line")
    out: TraceSeries | None = None
    steps: list[tuple[float, int, float]] = []
    t_first: float | None = None
    for n, raw in enumerate(lines, start=1):
        last = n == len(lines) and not complete
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            if last and n > 1 and _cut_off(raw):
                out.truncated = True
                break
            raise TraceFileError(f"{path}:{n}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceFileError(f"{path}:{n}: expected a JSON object")
        ev = obj.get("ev")
        if n == 1:
            if ev != "header":
                raise TraceFileError(f"{path}:1: expected a kvscope trace header")
            if obj.get("schema_version") != SCHEMA_VERSION:
                raise TraceFileError(f"{path}:1: unsupported schema_version "
                                     f"{obj.get('schema_version')!r}")
            out = TraceSeries(header=obj)
            continue
        if ev not in EVENTS:
            raise TraceFileError(f"{path}:{n}: unknown event {ev!r}")
        t = obj.get("t")
        if not _number(t):
            raise TraceFileError(f"{path}:{n}: 't' must be a number")
        out.events += 1
        t_first = t if t_first is None else min(t_first, t)
        if ev == "step":
            for key in STEP_INTS:
                if not isinstance(obj.get(key), int) or isinstance(obj.get(key), bool):
                    raise TraceFileError(f"{path}:{n}: step field {key!r} must be an integer")
            total = obj["kv_total"]
            steps.append((t, obj["tokens"], obj["kv_used"] / total if total > 0 else 0.0))
    for t, tokens, usage in steps:
        out.t.append(t - t_first)
        out.tokens.append(tokens)
        out.kv_usage.append(usage)
    return out
