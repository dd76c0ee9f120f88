"""The user's own prompts as probes: from a recorded session (--trace) or a file (--prompts).

A trace gives token ids as the engine saw them (engine/traces/workload.py reads both kvscope
traces and Mooncake-style workloads; prompts a trace does not carry are synthesised, seeded,
as replay does). A prompt file has one chat turn a line, sent through the chat template.
Cells are the prompt lengths rounded up to a power of two, so the grid reads by length as
the passkey grid does; there is no right answer, only float32 KV's.
"""
from __future__ import annotations

from pathlib import Path

from kvscope.engine.measure.kv_probes import Probe

MAX_ANSWER = 32  # tokens generated per prompt at most: enough to see a detour


def length_bucket(n: int) -> int:
    """n rounded up to a power of two (at least 16)."""
    b = 16
    while b < n:
        b *= 2
    return b


def probes_of(prompts: list[list[int]], max_tokens: list[int], max_model_len: int
              ) -> list[Probe]:
    out = []
    for ids, m in zip(prompts, max_tokens, strict=True):
        ids = ids[:max_model_len - 2]
        m = max(1, min(m, MAX_ANSWER, max_model_len - 1 - len(ids)))
        out.append(Probe(ids=ids, max_tokens=m, cell=(("length", length_bucket(len(ids))),)))
    return out


def trace_prompts(path: Path, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Prompt ids and max_tokens of every request of a kvscope or Mooncake-style trace."""
    from kvscope.engine.traces.workload import (
        is_mooncake,
        read_kvscope,
        read_mooncake,
        synthesise_prompts,
    )
    from kvscope.ipc.trace_format import read_trace

    items = read_mooncake(path) if is_mooncake(path) else read_kvscope(read_trace(path))
    if not items:
        raise ValueError(f"{path}: the trace has no requests")
    synthesise_prompts(items, vocab_size)
    return [list(i.prompt or []) for i in items], [i.max_tokens for i in items]


def file_prompts(path: Path, chat_template) -> tuple[list[list[int]], list[int]]:
    """One chat turn a line (blank lines and # lines skipped), through the chat template."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    if not lines:
        raise ValueError(f"{path}: no prompts (one a line; # lines are comments)")
    ids = [chat_template([{"role": "user", "content": q}]) for q in lines]
    return ids, [MAX_ANSWER] * len(ids)
