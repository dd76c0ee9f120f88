"""The per-step series of a trace (batch, tokens, KV usage, queues) as CSV, one row a step."""
from __future__ import annotations

import csv
import os

from kvscope.ipc.trace_format import Step, Trace

CSV_FIELDS = ["step", "t_us", "dur_us", "batch_size", "tokens", "budget", "kv_used",
              "kv_total", "kv_usage", "kv_tokens", "running", "waiting"]


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def step_rows(trace: Trace) -> list[list[int | float]]:
    """One row per step, in CSV_FIELDS order."""
    return [[n, _us(s.t), _us(s.dur), s.batch_size, s.tokens, s.budget, s.kv_used, s.kv_total,
             s.kv_used / s.kv_total if s.kv_total else 0, s.kv_tokens, s.running, s.waiting]
            for n, s in enumerate(trace.of_type(Step))]


def write_csv(trace: Trace, path: str | os.PathLike[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        w.writerows(step_rows(trace))
