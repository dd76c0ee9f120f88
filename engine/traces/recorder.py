"""Record an engine session to a JSONL trace.

The recorder is an observer the engine calls only while `engine.trace` is set (the core never
imports this package). Block allocations and frees are not reported by the block manager: the
recorder diffs every live sequence's block table before and after each step.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import msgspec

from kvscope.engine import __version__
from kvscope.engine.llm_engine import kv_dtype_name
from kvscope.engine.traces.schema import (
    SCHEMA_VERSION,
    Abort,
    Alloc,
    Arrival,
    Finish,
    Free,
    Header,
    Preempt,
    Reconfigure,
    Step,
    Token,
)


def start_trace(engine, path: str | os.PathLike, include_prompts: bool = True) -> TraceRecorder:
    """Record `engine`'s session to a new JSONL trace at path (replaced if it exists)."""
    engine.stop_trace()
    engine.trace = TraceRecorder(path, engine, include_prompts)
    return engine.trace


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, engine, include_prompts: bool = True) -> None:
        self.path = Path(path)
        self.include_prompts = include_prompts
        self.anchor = time.monotonic()
        # A new file per recording; lines are appended and flushed one by one as they happen.
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._enc = msgspec.json.Encoder()
        bm = engine.block_manager
        self._write(Header(
            schema_version=SCHEMA_VERSION, kvscope_version=__version__,
            model=engine.config.model, device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."), kv_dtype=kv_dtype_name(engine.kv_dtype),
            block_size=bm.block_size, num_kv_blocks=bm.num_blocks,
            config=engine.config.to_dict(), wall_time=time.time(), monotonic=self.anchor,
            include_prompts=include_prompts, kv_rotation=engine.kv_rotation))

    def _write(self, line) -> None:
        self._file.write(self._enc.encode(line) + b"\n")
        self._file.flush()

    def _t(self, when: float | None = None) -> float:
        return (time.monotonic() if when is None else when) - self.anchor

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    # -- hooks the engine calls ------------------------------------------------------------
    def on_arrival(self, seq) -> None:
        self._write(Arrival(t=self._t(seq.arrival_time), id=seq.request_id,
                            prompt_len=len(seq.prompt_token_ids), sampling=asdict(seq.params),
                            prompt=list(seq.prompt_token_ids) if self.include_prompts else None))

    def on_abort(self, seq) -> None:
        t = self._t()
        if seq.block_table:
            self._write(Free(t=t, id=seq.request_id, blocks=list(seq.block_table)))
        self._write(Abort(t=t, id=seq.request_id))

    def on_reconfigure(self, engine, live) -> None:
        """Called after the new pool is built, before the live requests drop their blocks."""
        t = self._t()
        for seq in live:
            if seq.block_table:
                self._write(Free(t=t, id=seq.request_id, blocks=list(seq.block_table)))
        bm = engine.block_manager
        self._write(Reconfigure(t=t, config=engine.config.to_dict(),
                                kv_dtype=kv_dtype_name(engine.kv_dtype),
                                block_size=bm.block_size, num_kv_blocks=bm.num_blocks,
                                kv_rotation=engine.kv_rotation))

    def record_step(self, engine, step):
        """Run `step()` (the engine's own) and write what it did."""
        sched = engine.scheduler
        before = {s.request_id: (list(s.block_table), s.num_preemptions, s)
                  for s in (*sched.running, *sched.waiting)}
        steps_before = engine.num_steps
        start = time.monotonic()
        deltas = step()
        end = time.monotonic()
        t, t_end = self._t(start), self._t(end)
        batch = engine.last_batch if engine.num_steps != steps_before else []
        for item in batch:
            seq = item.seq
            before.setdefault(seq.request_id, ([], seq.num_preemptions, seq))
        lines = []
        bm = engine.block_manager
        if batch or deltas:
            seqs = [(i.seq.request_id, i.num_tokens) for i in batch]
            lines.append(Step(
                t=t, dur=end - start, seqs=seqs, batch_size=len(batch),
                tokens=sum(n for _, n in seqs), budget=sched.max_num_batched_tokens,
                kv_used=bm.num_used_blocks, kv_total=bm.num_blocks,
                kv_tokens=sum(s.num_computed_tokens for s in sched.running),
                running=len(sched.running), waiting=len(sched.waiting)))
        for rid, (old, preemptions, seq) in before.items():
            new = seq.block_table
            if seq.num_preemptions > preemptions:
                lines.append(Preempt(t=t, id=rid))
            if old != new[:len(old)]:  # freed (preempted or finished), maybe re-allocated
                lines.append(Free(t=t, id=rid, blocks=old))
                old = []
            if len(new) > len(old):
                lines.append(Alloc(t=t, id=rid, blocks=new[len(old):]))
        for d in deltas:
            if d.token_ids:
                lines.append(Token(t=t_end, id=d.request_id, tokens=list(d.token_ids)))
            if d.finished:
                lines.append(Finish(t=t_end, id=d.request_id, reason=d.finish_reason or ""))
        if lines:
            self._file.write(b"".join(self._enc.encode(x) + b"\n" for x in lines))
            self._file.flush()
        return deltas
