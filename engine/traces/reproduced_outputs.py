"""What each request of a trace emitted, and whether a replay reproduced the recorded outputs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvscope.ipc.trace_format import Arrival, Finish, Token, Trace
from kvscope.kvmath.kv_dtypes import FULL_PRECISION_KV_DTYPES, ONE_BYTE_KV_DTYPES

# KV dtypes that store K/V unquantised: outputs are reproducible across block sizes.
FULL_PRECISION = FULL_PRECISION_KV_DTYPES


def outputs_of(trace: Trace) -> dict[str, list[int]]:
    """Each request's emitted token ids, in arrival order."""
    out: dict[str, list[int]] = {a.id: [] for a in trace.of_type(Arrival)}
    for ev in trace.of_type(Token):
        out.setdefault(ev.id, []).extend(ev.tokens)
    return out


class OutputCheck(msgspec.Struct):
    """identical is None when the comparison is not meaningful (`not_compared` says why)."""
    identical: bool | None
    not_compared: str | None = None
    compared: int = 0
    differing: list[str] = msgspec.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        if self.identical is None:
            return {"outputs_identical": None, "outputs_not_compared": self.not_compared}
        return {"outputs_identical": self.identical, "outputs_compared": self.compared,
                "outputs_differing": self.differing}


def why_not_comparable(sampling: Sequence[dict[str, Any]], recorded: Trace | None, new: Trace,
                       kv_dtype: str) -> str | None:
    """Why the new run's outputs need not match the recorded ones; None if they must.
    sampling: each request's sampling parameters; kv_dtype: the new run's configured one."""
    if recorded is None:
        return "the input is a workload trace without outputs"
    if not recorded.header.include_prompts:
        return "the recorded trace has no prompts (--no-prompts)"
    if any(float(s.get("temperature", 0.0)) != 0 for s in sampling):
        return "not every request used greedy sampling"
    kv = (recorded.header.kv_dtype, new.header.kv_dtype)
    if kv_dtype not in FULL_PRECISION or any(d in kv for d in ONE_BYTE_KV_DTYPES):
        return "quantised KV (int8/fp8) changes outputs"
    if recorded.header.dtype != new.header.dtype:
        return (f"the model ran in {recorded.header.dtype} when recorded and in "
                f"{new.header.dtype} now")
    return None


def check_outputs(sampling: Sequence[dict[str, Any]], recorded: Trace | None, new: Trace,
                  kv_dtype: str) -> OutputCheck:
    """Whether every finished request's output matches the recorded one, where meaningful."""
    why = why_not_comparable(sampling, recorded, new, kv_dtype)
    if why is not None or recorded is None:
        return OutputCheck(identical=None, not_compared=why)
    finished = {e.id for e in recorded.of_type(Finish)}
    old, now = outputs_of(recorded), outputs_of(new)
    differing = sorted(i for i in finished if old.get(i) != now.get(i))
    return OutputCheck(identical=not differing, compared=len(finished), differing=differing)
