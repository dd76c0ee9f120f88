"""Two runs' summaries side by side, with the ratio B/A of every number they share."""
from __future__ import annotations

from typing import Any

import msgspec

from kvscope.engine.traces.summary import TraceSummary, summarize
from kvscope.ipc.trace_format import Trace


class Comparison(msgspec.Struct):
    a: TraceSummary
    b: TraceSummary
    ratio: dict[str, float | None]  # B / A per numeric field; None where A is zero

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a.as_dict(), "b": self.b.as_dict(), "ratio": self.ratio}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """B/A for every key whose value is a number (not a bool) on both sides."""
    return {k: (b[k] / va if va else None) for k, va in a.items()
            if _is_number(va) and _is_number(b.get(k))}


def compare(a: TraceSummary, b: TraceSummary) -> Comparison:
    return Comparison(a=a, b=b, ratio=ratios(a.as_dict(), b.as_dict()))


def compare_traces(a: Trace, b: Trace) -> Comparison:
    return compare(summarize(a), summarize(b))
