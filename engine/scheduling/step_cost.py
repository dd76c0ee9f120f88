"""What a step costs, learned from the steps this engine ran: seconds from rows and keys.

A protected step (engine/scheduling/scheduler.py) fills the time the urgent work leaves with less
urgent work, so it must know what a piece of work costs before running it. Counting tokens is not
enough: a decode over a 700-token context reads its whole KV cache and cost about twice what a
prompt token in a chunk did, and a step's fixed part (the weights, once) is most of a small step.
The model, fitted by least squares over the last WINDOW steps:

    seconds = fixed + row * rows + decode_key * decode_keys + chunk_key * chunk_keys

where a decode (one row) reads its context's keys (decode_keys, thousands) and a chunk of n
rows starting at position s reads n * s + n(n+1)/2 keys (chunk_keys, tens of thousands).
Fitted on 7,000 steps of 16 background streams beside a chat (2-core AMX Xeon, SmolLM2 with
4-bit weights): 6.2 ms + 0.70 ms a row + 1.9 ms per 1k decode keys + 7.7 ms per 10k chunk
keys, R^2 0.91, residual p90 4.7 ms (the rest is the box: the HTTP server and the client
share its two cores). A coefficient the fit makes negative is held at 0 and the rest refitted:
more work never costs less. Machine, model, weight format and KV dtype all change the
coefficients, which is why they are measured, not written here.

The engine feeds it the protected steps only (a chat's decode and a few less urgent tokens),
the only steps it is asked about. Fitted over every step, the background's 48-row steps
between chats set the line: on an AVX2 EPYC it then put a small step's fixed part at 15 ms
(7 in fact) and 4 prompt tokens at 14 ms (27 in fact), so the first seconds of each load
beside a chat ran 40-ms steps at a stretch of 2 (the chat's ITL p99 56 ms, against 34 once
the window held protected steps only; docs/scheduling.md). Until MIN_STEPS protected steps
were seen, a second model stands in: fitted over every step, each weighted by 1 / its
seconds (`relative`: least squares on the relative error, so the many small steps are not
outweighed by the few big ones; on that trace it put the fixed part at 7.6 ms).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

WINDOW = 512  # steps the fit looks at
REFIT_EVERY = 32  # steps between refits
MIN_STEPS = 64  # steps observed before the model predicts anything
# Feature scales (keys in thousands and tens of thousands) keep the least squares well posed.
DECODE_KEY_SCALE = 1e-3
CHUNK_KEY_SCALE = 1e-4


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost is fitted on: its rows and the keys they read."""
    rows: int = 0
    decode_keys: int = 0
    chunk_keys: int = 0

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.rows), self.decode_keys * DECODE_KEY_SCALE,
                self.chunk_keys * CHUNK_KEY_SCALE)


def work_keys(start: int, num_tokens: int) -> tuple[int, int]:
    """(decode keys, chunk keys) of num_tokens rows of one sequence from position start."""
    if num_tokens == 1:
        return start + 1, 0
    return 0, num_tokens * start + num_tokens * (num_tokens + 1) // 2


def step_shape(work: Iterable[tuple[int, int]]) -> StepShape:
    """The shape of a step from its (start position, rows) per sequence."""
    rows = decode = chunk = 0
    for start, n in work:
        d, c = work_keys(start, n)
        rows, decode, chunk = rows + n, decode + d, chunk + c
    return StepShape(rows, decode, chunk)


@dataclass
class StepCost:
    """The fitted model; None-returning until MIN_STEPS steps were observed."""
    window: int = WINDOW
    refit_every: int = REFIT_EVERY
    min_steps: int = MIN_STEPS
    coef: tuple[float, float, float, float] | None = None  # fixed, row, decode key, chunk key
    relative: bool = False  # fit the relative error (each step weighted by 1 / its seconds)
    _x: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    _y: deque[float] = field(default_factory=deque)
    _since_fit: int = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of this shape took `seconds` (a step cut short is not observed)."""
        if shape.rows <= 0 or not seconds > 0:
            return
        self._x.append(shape.features())
        self._y.append(seconds)
        if len(self._y) > self.window:
            self._x.popleft()
            self._y.popleft()
        self._since_fit += 1
        if len(self._y) >= self.min_steps and (self.coef is None
                                               or self._since_fit >= self.refit_every):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x, y = np.asarray(self._x), np.asarray(self._y)
        if self.relative:
            x, y = x / y[:, None], np.ones_like(y)
        kept = [0, 1, 2, 3]
        while True:  # active set: drop what comes out negative, refit the rest
            got, *_ = np.linalg.lstsq(x[:, kept], y, rcond=None)
            negative = [k for k, c in zip(kept, got, strict=True) if c < 0]
            if not negative:
                break
            kept = [k for k in kept if k not in negative]
            if not kept:
                return
        coef = [0.0] * 4
        for k, c in zip(kept, got, strict=True):
            coef[k] = float(c)
        self.coef = (coef[0], coef[1], coef[2], coef[3])

    @property
    def observed_seconds(self) -> tuple[float, ...]:
        """The step times the fit looks at, oldest first."""
        return tuple(self._y)

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def predict(self, shape: StepShape) -> float | None:
        if self.coef is None:
            return None
        return float(sum(c * f for c, f in zip(self.coef, shape.features(), strict=True)))

    @property
    def fixed_seconds(self) -> float:
        return 0.0 if self.coef is None else self.coef[0]

    def work_seconds(self, start: int, num_tokens: int) -> float:
        """What num_tokens rows of one sequence from position start add to a step."""
        if self.coef is None or num_tokens <= 0:
            return 0.0
        _, row, decode_key, chunk_key = self.coef
        d, c = work_keys(start, num_tokens)
        return row * num_tokens + decode_key * d * DECODE_KEY_SCALE \
            + chunk_key * c * CHUNK_KEY_SCALE

    def tokens_within(self, start: int, most: int, seconds: float) -> int:
        """How many of a sequence's next `most` tokens from position start fit in seconds."""
        if self.coef is None or most <= 0 or seconds <= 0:
            return 0
        if self.work_seconds(start, most) <= seconds:
            return most
        lo, hi = 0, most  # work_seconds rises with the tokens: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.work_seconds(start, mid) <= seconds:
                lo = mid
            else:
                hi = mid
        return lo
