"""Record an engine session to a JSONL trace.

The recorder is an observer the engine calls only while `engine.trace` is set (the core never
imports this package). Block allocations and frees are not reported by the block manager: the
recorder diffs every live sequence's block table before and after each step.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from kvscope.engine import __version__
from kvscope.engine.kv_cache.block_manager import FREED
from kvscope.engine.llm_engine import LLMEngine, kv_dtype_name
from kvscope.engine.outputs import StepResult, TokenDelta
from kvscope.engine.sequence import Sequence
from kvscope.ipc.trace_format import (
    SCHEMA_VERSION,
    Abort,
    Alloc,
    Arrival,
    Event,
    Finish,
    Free,
    Header,
    Offload,
    Onboard,
    Preempt,
    Reconfigure,
    Step,
    Token,
    TraceWriter,
)


def start_trace(engine: LLMEngine, path: str | os.PathLike,
                include_prompts: bool = True) -> TraceRecorder:
    """Record `engine`'s session to a new JSONL trace at path (replaced if it exists)."""
    engine.stop_trace()
    engine.trace = TraceRecorder(path, engine, include_prompts)
    return engine.trace


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, engine: LLMEngine,
                 include_prompts: bool = True) -> None:
        self.path = Path(path)
        self.include_prompts = include_prompts
        self.anchor = time.monotonic()
        bm = engine.block_manager
        # A new file per recording; lines are appended and flushed as they happen.
        self._out = TraceWriter(self.path, Header(
            schema_version=SCHEMA_VERSION, kvscope_version=__version__,
            model=engine.config.model, device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."), kv_dtype=kv_dtype_name(engine.kv_dtype),
            block_size=bm.block_size, num_kv_blocks=bm.num_blocks,
            config=engine.config.to_dict(), wall_time=time.time(), monotonic=self.anchor,
            include_prompts=include_prompts, kv_rotation=engine.kv_rotation))

    def _write(self, line: Event) -> None:
        self._out.write([line])

    def _t(self, when: float | None = None) -> float:
        return (time.monotonic() if when is None else when) - self.anchor

    @property
    def closed(self) -> bool:
        return self._out.closed

    def close(self) -> None:
        self._out.close()

    # -- hooks the engine calls ------------------------------------------------------------
    def on_arrival(self, seq: Sequence) -> None:
        self._write(Arrival(t=self._t(seq.arrival_time), id=seq.request_id,
                            prompt_len=len(seq.prompt_token_ids), sampling=asdict(seq.params),
                            prompt=list(seq.prompt_token_ids) if self.include_prompts else None))

    def on_abort(self, seq: Sequence) -> None:
        t = self._t()
        if held(seq.block_table):
            self._write(Free(t=t, id=seq.request_id, blocks=held(seq.block_table)))
        self._write(Abort(t=t, id=seq.request_id))

    def on_reconfigure(self, engine: LLMEngine, live: Iterable[Sequence]) -> None:
        """Called after the new pool is built, before the live requests drop their blocks."""
        t = self._t()
        for seq in live:
            if held(seq.block_table):
                self._write(Free(t=t, id=seq.request_id, blocks=held(seq.block_table)))
        bm = engine.block_manager
        self._write(Reconfigure(t=t, config=engine.config.to_dict(),
                                kv_dtype=kv_dtype_name(engine.kv_dtype),
                                block_size=bm.block_size, num_kv_blocks=bm.num_blocks,
                                kv_rotation=engine.kv_rotation))

    def record_step(self, engine: LLMEngine, step: Callable[[], StepResult]) -> StepResult:
        """Run `step()` (the engine's own) and write what it did."""
        sched = engine.scheduler
        before = {s.request_id: _Held(list(s.block_table), s.num_preemptions, s)
                  for s in (*sched.running, *sched.waiting)}
        tiers = engine.block_manager.tiers
        if tiers is not None:  # the tiers' offloads and onboardings, this step's
            tiers.trace_events = []
        start = time.monotonic()
        result = step()
        end = time.monotonic()
        t = self._t(start)
        for item in result.scheduled:  # admitted and scheduled in this very step
            before.setdefault(item.seq.request_id, _Held([], item.seq.num_preemptions, item.seq))
        lines: list[Event] = []
        if result.scheduled or result.outputs:
            lines.append(_step_line(engine, result, t, end - start))
        reasons = {p.request_id: p.reason for p in sched.last_preemptions}
        lines += _block_lines(before, t, reasons)
        if tiers is not None:
            lines += _tier_lines(tiers.trace_events or [], t)
            tiers.trace_events = None
        lines += _token_lines(result.outputs, self._t(end))
        self._out.write(lines)
        return result


class _Held(NamedTuple):
    """A live sequence's block table and preemption count before a step."""
    blocks: list[int]
    preemptions: int
    seq: Sequence


def _step_line(engine: LLMEngine, result: StepResult, t: float, dur: float) -> Step:
    sched, bm = engine.scheduler, engine.block_manager
    seqs = [(i.seq.request_id, i.num_tokens) for i in result.scheduled]
    return Step(t=t, dur=dur, seqs=seqs, batch_size=len(seqs), tokens=sum(n for _, n in seqs),
                budget=sched.max_num_batched_tokens, kv_used=bm.num_used_blocks,
                kv_total=bm.num_blocks,
                kv_tokens=sum(s.num_computed_tokens for s in sched.running),
                running=len(sched.running), waiting=len(sched.waiting),
                spec=[(v.request_id, v.drafted, v.accepted) for v in engine.spec.last_step])


def _block_lines(before: dict[str, _Held], t: float,
                 reasons: dict[str, str] | None = None) -> list[Event]:
    """Preemptions (with the scheduler's reason, `reasons` by request id), frees and
    allocations, from each block table before and after the step (the block manager does
    not report them)."""
    lines: list[Event] = []
    for rid, (old, preemptions, seq) in before.items():
        new = seq.block_table
        if seq.num_preemptions > preemptions:
            lines.append(Preempt(t=t, id=rid, reason=(reasons or {}).get(rid, "")))
        pairs = list(zip(old, new, strict=False))
        if len(new) >= len(old) and all(now in (b, FREED) for b, now in pairs):
            behind = [b for b, now in pairs if b != now]
            if behind:  # left behind a sliding window: only those blocks went back
                lines.append(Free(t=t, id=rid, blocks=behind))
        else:  # freed (preempted or finished), maybe re-allocated
            if held(old):
                lines.append(Free(t=t, id=rid, blocks=held(old)))
            old = []
        if len(new) > len(old) and held(new[len(old):]):
            lines.append(Alloc(t=t, id=rid, blocks=held(new[len(old):])))
    return lines


def _tier_lines(events, t: float) -> list[Event]:
    """Offloads (summed per medium) and onboardings (per request) of one step."""
    offloaded: dict[str, int] = {}
    lines: list[Event] = []
    for e in events:
        if e.kind == "offload":
            offloaded[e.medium] = offloaded.get(e.medium, 0) + e.blocks
        else:
            lines.append(Onboard(t=t, id=e.request_id, blocks=e.blocks, medium=e.medium))
    return [Offload(t=t, blocks=n, medium=medium) for medium, n in offloaded.items()] + lines


def held(table: list[int]) -> list[int]:
    """The blocks of a table, without the entries freed behind a sliding window."""
    return [b for b in table if b != FREED]


def _token_lines(deltas: list[TokenDelta], t: float) -> list[Event]:
    lines: list[Event] = []
    for d in deltas:
        if d.token_ids:
            lines.append(Token(t=t, id=d.request_id, tokens=list(d.token_ids)))
        if d.finished:
            lines.append(Finish(t=t, id=d.request_id, reason=d.finish_reason or ""))
    return lines
