"""A small hand-written session trace (no model): two requests, one preempted and recomputed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from kvscope.ipc.trace_format import (
    SCHEMA_VERSION,
    Alloc,
    Arrival,
    Event,
    Finish,
    Free,
    Header,
    Preempt,
    Step,
    Token,
    Trace,
    TraceWriter,
)

BLOCK_SIZE, NUM_BLOCKS = 4, 16


def header(**changes: Any) -> Header:
    base = Header(schema_version=SCHEMA_VERSION, kvscope_version="test", model="m",
                  device="cpu", dtype="float32", kv_dtype="float32", block_size=BLOCK_SIZE,
                  num_kv_blocks=NUM_BLOCKS, config={"block_size": BLOCK_SIZE},
                  wall_time=1.7e9, monotonic=100.0, include_prompts=True)
    return msgspec.structs.replace(base, **changes)


def step(t: float, seqs: list[tuple[str, int]], kv_used: int, kv_tokens: int,
         dur: float = 0.05) -> Step:
    return Step(t=t, dur=dur, seqs=seqs, batch_size=len(seqs), tokens=sum(n for _, n in seqs),
                budget=64, kv_used=kv_used, kv_total=NUM_BLOCKS, kv_tokens=kv_tokens,
                running=len(seqs), waiting=0)


def events() -> list[Event]:
    """r0 (6-token prompt) and r1 (3 tokens) prefill together; r1 is preempted after its first
    token, recomputed, and finishes last."""
    greedy = {"max_tokens": 2, "temperature": 0.0}
    return [
        Arrival(t=0.0, id="r0", prompt_len=6, sampling=greedy, prompt=[1, 2, 3, 4, 5, 6]),
        Arrival(t=0.1, id="r1", prompt_len=3, sampling=greedy, prompt=[7, 8, 9]),
        step(0.2, [("r0", 6), ("r1", 3)], kv_used=3, kv_tokens=9),
        Alloc(t=0.2, id="r0", blocks=[0, 1]),
        Alloc(t=0.2, id="r1", blocks=[2]),
        Token(t=0.25, id="r0", tokens=[11]),
        Token(t=0.25, id="r1", tokens=[21]),
        step(0.3, [("r0", 1)], kv_used=2, kv_tokens=7),
        Preempt(t=0.3, id="r1"),
        Free(t=0.3, id="r1", blocks=[2]),
        Token(t=0.35, id="r0", tokens=[12]),
        Finish(t=0.35, id="r0", reason="length"),
        Free(t=0.35, id="r0", blocks=[0, 1]),
        step(0.4, [("r1", 4)], kv_used=1, kv_tokens=4),
        Alloc(t=0.4, id="r1", blocks=[3]),
        Token(t=0.45, id="r1", tokens=[22]),
        Finish(t=0.45, id="r1", reason="length"),
    ]


def trace(**header_changes: Any) -> Trace:
    return Trace(header(**header_changes), events())


def write(path: Path, evs: list[Event] | None = None, **header_changes: Any) -> Path:
    writer = TraceWriter(path, header(**header_changes))
    writer.write(events() if evs is None else evs)
    writer.close()
    return path
