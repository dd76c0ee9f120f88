"""Replay a recorded session (or a Mooncake-style workload) against another engine config,
recording the new run as a trace of its own."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.traces.recorder import start_trace
from kvscope.engine.traces.reproduced_outputs import OutputCheck, check_outputs
from kvscope.engine.traces.summary import TraceSummary, summarize
from kvscope.engine.traces.workload import (
    WorkItem,
    is_mooncake,
    read_kvscope,
    read_mooncake,
    synthesise_prompts,
)
from kvscope.ipc.trace_format import Trace, read_trace


class ReplayResult(msgspec.Struct):
    summary: TraceSummary  # of the new run
    trace: str  # the new run's trace file
    rejected: dict[str, str]  # request id -> why the engine refused it
    outputs: OutputCheck

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON `kvscope trace replay --json` prints (the window reads it)."""
        return {**self.summary.as_dict(), "trace": self.trace, "rejected": self.rejected,
                **self.outputs.as_dict()}


def load_workload(path: str | os.PathLike[str]) -> tuple[list[WorkItem], Trace | None]:
    """The requests to replay, and the kvscope trace they came from (None for Mooncake)."""
    if is_mooncake(path):
        return read_mooncake(path), None
    trace = read_trace(path)
    return read_kvscope(trace), trace


def default_output_path(source: str | os.PathLike[str]) -> str:
    """TRACE.replay.jsonl beside the input."""
    return str(Path(source).with_suffix("")) + ".replay.jsonl"


def replay(items: list[WorkItem], engine: LLMEngine, out_path: str | os.PathLike[str],
           speed: float | None, include_prompts: bool = True, prompt_seed: int = 0,
           hash_block_size: int = 512) -> dict[str, str]:
    """Submit the arrivals (times scaled by 1/speed; all at once when speed is None) while
    recording to out_path; returns the requests the engine refused, with why."""
    synthesise_prompts(items, engine.model.shape.vocab_size, prompt_seed, hash_block_size)
    pending = sorted(items, key=lambda w: w.t)
    rejected: dict[str, str] = {}
    start_trace(engine, out_path, include_prompts)
    try:
        i, t0 = 0, time.monotonic()
        while i < len(pending) or engine.has_unfinished():
            now = time.monotonic() - t0
            while i < len(pending) and (speed is None or pending[i].t / speed <= now):
                w = pending[i]
                i += 1
                try:
                    engine.add_request(w.prompt, _params(w), w.request_id)
                except (ValueError, TypeError) as exc:
                    rejected[w.request_id] = str(exc)
            if engine.has_unfinished():
                engine.step()
            elif i < len(pending) and speed is not None:
                time.sleep(min(0.5, max(0.0, pending[i].t / speed - now)))
    finally:
        engine.stop_trace()
    return rejected


def _params(w: WorkItem) -> SamplingParams:
    """The recorded sampling, at the recorded priority (0 for traces from before it)."""
    return SamplingParams(**{**w.sampling, "priority": w.priority})


def replay_file(source: str | os.PathLike[str], out_path: str | os.PathLike[str],
                config: EngineConfig, speed: float | None, include_prompts: bool = True,
                prompt_seed: int = 0, hash_block_size: int = 512) -> ReplayResult:
    """Replay the trace or workload at `source` on a new engine; summarise the new run and
    check its outputs against the recorded ones."""
    if speed is not None and not speed > 0:
        raise ValueError(f"speed {speed} must be a positive number (or None: as fast as it goes)")
    if Path(out_path).resolve() == Path(source).resolve():
        raise ValueError("the output must not be the input trace")
    items, recorded = load_workload(source)
    rejected = replay(items, LLMEngine(config), out_path, speed, include_prompts, prompt_seed,
                      hash_block_size)
    new = read_trace(out_path)
    outputs = check_outputs([w.sampling for w in items], recorded, new, config.kv_dtype)
    return ReplayResult(summary=summarize(new), trace=str(out_path), rejected=rejected,
                        outputs=outputs)
