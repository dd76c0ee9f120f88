"""When speculation pays: measured per batch size, never assumed.

For every batch-size bucket (1, 2, 3-4, 5-8, ...) the engine keeps two moving averages of
pure-decode steps, tokens emitted per second with drafts and without. A step speculates
when its bucket's measured rate with drafts is at least the rate without; while either side
of a bucket has too few samples, or now and then (every 16th step plain while drafts win,
every 64th step with drafts while they lose: a losing probe costs a step), the other choice
is tried so both estimates stay current (load, acceptance and the machine all drift). The acceptance
rate is inside the measured rate: tokens per verify step are 1 + accepted drafts per
request, and the step's time includes the verify's extra query tokens, so a workload whose
drafts are rejected, or a batch large enough that the extra tokens stop being free, backs
off by itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_SAMPLES = 4
ALPHA = 0.2  # weight of a new step in the moving averages


@dataclass(slots=True)
class Rate:
    """Moving averages of one bucket's steps: tokens emitted and seconds, per step."""
    samples: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if self.samples == 0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens += ALPHA * (tokens - self.tokens)
            self.seconds += ALPHA * (seconds - self.seconds)
        self.samples += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class BackOff:
    enabled: bool = True
    probe_plain_every: int = 16
    probe_spec_every: int = 64
    plain: dict[int, Rate] = field(default_factory=dict)
    spec: dict[int, Rate] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def bucket(batch_size: int) -> int:
        """1, 2, 4, 8, ...: the power of two at or above the batch size."""
        return 1 << max(0, batch_size - 1).bit_length()

    def should_speculate(self, batch_size: int) -> bool:
        if not self.enabled:
            return True
        b = self.bucket(batch_size)
        plain, spec = self.plain.get(b), self.spec.get(b)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        if spec is None or spec.samples < MIN_SAMPLES:
            return True
        if plain is None or plain.samples < MIN_SAMPLES:
            return False
        if spec.per_second >= plain.per_second:
            return n % self.probe_plain_every != 0
        return n % self.probe_spec_every == 0

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        table = self.spec if speculated else self.plain
        table.setdefault(self.bucket(batch_size), Rate()).add(tokens, seconds)

    def speedup(self, batch_size: int) -> float | None:
        """Measured tok/s with drafts over without at this batch size (None: not measured)."""
        b = self.bucket(batch_size)
        plain, spec = self.plain.get(b), self.spec.get(b)
        if not plain or not spec or not plain.per_second:
            return None
        return spec.per_second / plain.per_second
