"""Record an engine session to a JSONL trace, and read one back (strictly: it is untrusted).

The recorder is an observer the engine calls only when `engine.trace` is set. Block
allocations and frees are not reported by the block manager: the recorder diffs every live
sequence's block table before and after each step.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from engine.trace_schema import (
    SCHEMA_VERSION,
    Abort,
    Alloc,
    Arrival,
    Event,
    Finish,
    Free,
    Header,
    Preempt,
    Reconfigure,
    Step,
    Token,
)


class TraceError(ValueError):
    """A trace file that does not validate; the message names the line and the reason."""


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, engine, include_prompts: bool = True) -> None:
        from engine import __version__
        from engine.llm_engine import kv_dtype_name

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
            include_prompts=include_prompts))

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
        from engine.llm_engine import kv_dtype_name

        t = self._t()
        for seq in live:
            if seq.block_table:
                self._write(Free(t=t, id=seq.request_id, blocks=list(seq.block_table)))
        bm = engine.block_manager
        self._write(Reconfigure(t=t, config=engine.config.to_dict(),
                                kv_dtype=kv_dtype_name(engine.kv_dtype),
                                block_size=bm.block_size, num_kv_blocks=bm.num_blocks))

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


# -- reading -------------------------------------------------------------------------------
@dataclass
class Trace:
    header: Header
    events: list = field(default_factory=list)
    truncated: bool = False  # the last line was cut off (a killed writer) and was dropped

    def of_type(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


_header_decoder = msgspec.json.Decoder(Header)
_event_decoder = msgspec.json.Decoder(Event)


def read_trace(path: str | os.PathLike) -> Trace:
    """Parse a kvscope trace strictly. A cut-off last line is tolerated, nothing else."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    complete_end = data.endswith(b"\n")
    if complete_end:
        lines.pop()
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}:1: empty file or missing header line")
    header = _read_header(path, lines[0], is_last=len(lines) == 1 and not complete_end)
    trace = Trace(header)
    for n, raw in enumerate(lines[1:], start=2):
        is_last = n == len(lines)
        try:
            trace.events.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if is_last and not complete_end and _is_cut_json(raw):
                trace.truncated = True
                break
            raise TraceError(f"{path}:{n}: {exc}") from None
    return trace


def _is_cut_json(raw: bytes) -> bool:
    """Whether a line reads as the beginning of a JSON value that was cut off."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(raw.rstrip()) or "Unterminated" in exc.msg
    return False


def _read_header(path, raw: bytes, is_last: bool) -> Header:
    try:
        generic = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        if is_last and _is_cut_json(raw):
            raise TraceError(f"{path}:1: the header line is cut off (empty trace)") from None
        raise TraceError(f"{path}:1: not JSON: {exc}") from None
    if not isinstance(generic, dict) or generic.get("ev") != "header":
        raise TraceError(f"{path}:1: expected a kvscope trace header "
                         f'({{"ev": "header", ...}}), got {str(generic)[:80]}')
    version = generic.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TraceError(f"{path}:1: unsupported schema_version {version!r} "
                         f"(this kvscope reads version {SCHEMA_VERSION})")
    try:
        return _header_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}:1: {exc}") from None


def outputs_of(trace: Trace) -> dict[str, list[int]]:
    """Each request's emitted token ids, in arrival order."""
    out = {a.id: [] for a in trace.of_type(Arrival)}
    for ev in trace.of_type(Token):
        out.setdefault(ev.id, []).extend(ev.tokens)
    return out


def request_lengths(path: str | os.PathLike) -> list[int]:
    """Total tokens (prompt + output) per request, from a kvscope or a Mooncake-style trace."""
    from engine.workload import is_mooncake, read_mooncake

    if is_mooncake(path):
        return [w.prompt_len + w.max_tokens for w in read_mooncake(path)]
    trace = read_trace(path)
    outs = outputs_of(trace)
    return [a.prompt_len + len(outs.get(a.id, [])) for a in trace.of_type(Arrival)]


__all__ = ["Abort", "Alloc", "Arrival", "Finish", "Free", "Preempt", "Step", "Token",
           "Trace", "TraceError", "TraceRecorder", "outputs_of", "read_trace",
           "request_lengths"]
