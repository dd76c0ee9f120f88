"""Replay input: the arrivals of a kvscope trace, or a Mooncake/Alibaba-style workload trace.

Mooncake-style JSONL has one request per line: {"timestamp": ms, "input_length": n,
"output_length": m, "hash_ids": [...]} (hash_ids optional). Prompts are synthesised with a
seeded generator; each hash id stands for one block of `hash_block_size` tokens, so requests
that share hash ids share a prompt prefix (and can hit the prefix cache).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvscope.engine.traces.reproduced_outputs import outputs_of
from kvscope.ipc.trace_format import Arrival, Trace, TraceError, read_trace


@dataclass
class WorkItem:
    t: float  # seconds after the first arrival
    request_id: str
    prompt_len: int
    max_tokens: int
    sampling: dict = field(default_factory=dict)
    prompt: list[int] | None = None
    hash_ids: list[int] | None = None
    recorded_output: list[int] | None = None
    priority: object = 0  # lower = sooner; replay submits with it (SamplingParams checks it)


class MooncakeRequest(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] | None = None
    priority: int = 0  # not in Mooncake's own traces; lets a workload mix priorities


_mooncake = msgspec.json.Decoder(MooncakeRequest)


def is_mooncake(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        first = f.readline()
    try:
        obj = msgspec.json.decode(first)
    except msgspec.DecodeError:
        return False
    return isinstance(obj, dict) and "ev" not in obj and "input_length" in obj


def read_mooncake(path: str | os.PathLike) -> list[WorkItem]:
    items = []
    raw_lines = Path(path).read_bytes().splitlines()
    for n, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            r = _mooncake.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if n == len(raw_lines) and not Path(path).read_bytes().endswith(b"\n"):
                break  # a cut-off last line
            raise TraceError(f"{path}:{n}: {exc}") from None
        if r.input_length < 1 or r.output_length < 1:
            raise TraceError(f"{path}:{n}: input_length and output_length must be >= 1")
        items.append(WorkItem(t=r.timestamp / 1000.0, request_id=f"mc-{n - 1}",
                              prompt_len=r.input_length, max_tokens=r.output_length,
                              sampling={"max_tokens": r.output_length, "ignore_eos": True},
                              hash_ids=r.hash_ids, priority=r.priority))
    if not items:
        raise TraceError(f"{path}: no requests")
    t0 = min(i.t for i in items)
    for i in items:
        i.t -= t0
    return items


def read_kvscope(trace: Trace) -> list[WorkItem]:
    """The arrivals of a kvscope trace as replay input, with what each request emitted."""
    arrivals = trace.of_type(Arrival)
    outs = outputs_of(trace)
    t0 = min((a.t for a in arrivals), default=0.0)
    return [WorkItem(t=a.t - t0, request_id=a.id, prompt_len=a.prompt_len,
                     max_tokens=int(a.sampling.get("max_tokens", 64)), sampling=dict(a.sampling),
                     prompt=list(a.prompt) if a.prompt is not None else None,
                     recorded_output=outs.get(a.id), priority=a.priority) for a in arrivals]


def synthesise_prompts(items: list[WorkItem], vocab_size: int, seed: int = 0,
                       hash_block_size: int = 16) -> None:
    """Fill in prompts that a trace does not carry (seeded; shared hash ids → shared blocks)."""
    blocks: dict[int, list[int]] = {}
    for k, item in enumerate(items):
        if item.prompt is not None:
            continue
        tokens: list[int] = []
        for h in item.hash_ids or []:
            if h not in blocks:
                rng = random.Random(f"{seed}:block:{h}")
                blocks[h] = [rng.randrange(vocab_size) for _ in range(hash_block_size)]
            tokens += blocks[h]
            if len(tokens) >= item.prompt_len:
                break
        rng = random.Random(f"{seed}:request:{k}")
        tokens += [rng.randrange(vocab_size) for _ in range(item.prompt_len - len(tokens))]
        item.prompt = tokens[:item.prompt_len]


def request_lengths(path: str | os.PathLike) -> list[int]:
    """Total tokens (prompt + output) per request, from a kvscope or a Mooncake-style trace."""
    if is_mooncake(path):
        return [w.prompt_len + w.max_tokens for w in read_mooncake(path)]
    trace = read_trace(path)
    outs = outputs_of(trace)
    return [a.prompt_len + len(outs.get(a.id, [])) for a in trace.of_type(Arrival)]
