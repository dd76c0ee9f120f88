"""What a load run against an OpenAI-compatible URL measured: TTFT, inter-token latency and
throughput, as `vllm bench serve` reports them (plain Python, no Qt)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


def gamma_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """Seconds to the next arrival: gamma-distributed with mean 1/rate; burstiness is the
    shape (1 = Poisson, below 1 burstier, above 1 more even), as in vllm bench serve."""
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class LoadStats:
    started: float | None = None  # monotonic seconds of the first request
    last_finish: float | None = None
    done: int = 0
    failed: int = 0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the latest few, for the panel

    def on_sent(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def on_done(self, now: float, ttft: float | None, gaps: list[float], tokens: int) -> None:
        self.done += 1
        self.last_finish = now
        self.output_tokens += tokens
        if ttft is not None:
            self.ttft.append(ttft)
        self.itl.extend(gaps)

    def on_failed(self, message: str) -> None:
        self.failed += 1
        self.errors = (self.errors + [message])[-3:]

    @property
    def output_tokens_per_s(self) -> float | None:
        if self.started is None or self.last_finish is None or self.last_finish <= self.started:
            return None
        return self.output_tokens / (self.last_finish - self.started)

    def summary(self) -> str:
        def ms(v):
            return "—" if v is None else f"{1e3 * v:.0f} ms"

        rate = self.output_tokens_per_s
        return (f"done {self.done} · failed {self.failed} · "
                f"{'—' if rate is None else f'{rate:.1f}'} output tok/s\n"
                f"TTFT p50 {ms(percentile(self.ttft, 50))} · p99 {ms(percentile(self.ttft, 99))}"
                f"\nITL p50 {ms(percentile(self.itl, 50))} · p99 {ms(percentile(self.itl, 99))}")
