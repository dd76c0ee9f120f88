"""ServerSamples as the frames app.plots.BatchPlots draws (the same plots as for kvscope's own
engine). What /metrics cannot say stays empty: there is no token budget, and the batch plot
shows tokens per step averaged over a scrape interval, not each step."""
from __future__ import annotations

from dataclasses import dataclass

from kvscope.app.vllm.server_sample import ServerSample


@dataclass(frozen=True)
class StepRecord:
    step: int
    time: float
    prefill_tokens: float | None
    decode_tokens: float | None
    num_running: float | None
    num_waiting: float | None


@dataclass(frozen=True)
class StepFrame:
    time: float
    history: list[StepRecord]
    num_preempted: float | None  # preemptions in the interval
    token_budget: None = None  # vLLM's max_num_batched_tokens is not in /metrics


@dataclass(frozen=True)
class KvFrame:
    """BatchPlots draws used / num_blocks; vLLM gives the ratio itself, so it is per mille."""

    time: float
    used: float
    num_blocks: int = 1000


@dataclass(frozen=True)
class Pct:
    p50: float | None
    p90: float | None


@dataclass(frozen=True)
class StatsFrame:
    time: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    ttft_s: Pct
    itl_s: Pct
    kv_usage: float | None  # None: the server does not report it


@dataclass
class PlotFeed:
    index: int = 0


    def frames_of(self, s: ServerSample) -> tuple[StepFrame, KvFrame | None, StatsFrame]:
        self.index += 1
        steps = s.steps or 0
        prefill = None if not steps or s.prompt_tokens_per_s is None else \
            s.prompt_tokens_per_s * s.interval_s / steps
        decode = None if not steps or s.generation_tokens_per_s is None else \
            s.generation_tokens_per_s * s.interval_s / steps
        step = StepFrame(s.time, [StepRecord(self.index, s.time, prefill, decode, s.running,
                                             s.waiting)], s.preemptions)
        kv = None if s.kv_usage is None else KvFrame(s.time, s.kv_usage * 1000)
        stats = StatsFrame(s.time, s.prompt_tokens_per_s or 0.0, s.generation_tokens_per_s or 0.0,
                           Pct(s.ttft_p50_s, s.ttft_p90_s), Pct(s.itl_p50_s, s.itl_p90_s),
                           s.kv_usage)
        return step, kv, stats
