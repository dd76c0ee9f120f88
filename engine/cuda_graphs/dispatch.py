"""Which path a step takes: the graph of a batch-size bucket, or eager, and why.

As vLLM v1's dispatcher (a batch descriptor -> FULL / PIECEWISE / NONE) but with two
answers: a decode-only step of B <= the largest bucket replays the smallest bucket >= B (its
rows past B padded and neutralised); anything else runs eagerly, with the reason kept for
the step frame, the trace and /metrics.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# Eager reasons (StepPath.reason), stable strings: the step frame, traces and /metrics carry them.
PREFILL = "prefill"
VERIFY = "speculative verify"
ABOVE = "above largest bucket"
OFF = "graphs off"


@dataclass(frozen=True)
class StepPath:
    bucket: int  # the graph's batch size; 0: eager
    reason: str = ""  # why eager ("" when graphed)

    @property
    def label(self) -> str:
        """"graph:16", or "eager:prefill" and the like (the step frame's step_path)."""
        return f"graph:{self.bucket}" if self.bucket else f"eager:{self.reason}"


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The buckets captured for max_num_seqs, ascending: 1, 2, 4, 8, then every 16 (as
    nano-vllm), and max_num_seqs itself, so every decode batch the scheduler can form has
    one. Padding stays under 2x for small batches and under 16 rows for large ones."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} is invalid: expected >= 1")
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


def choose_path(num_tokens: Sequence[int], drafted: bool, sizes: Sequence[int],
                off_reason: str | None) -> StepPath:
    """The path of a step whose sequences carry `num_tokens` tokens each; `sizes` the
    captured buckets (ascending), `off_reason` why there are none (None: they exist)."""
    if off_reason is not None:
        return StepPath(0, OFF)  # why: EngineStats.cuda_graphs_reason
    if drafted:
        return StepPath(0, VERIFY)
    if any(n != 1 for n in num_tokens):
        return StepPath(0, PREFILL)
    i = bisect_left(sizes, len(num_tokens))
    if i == len(sizes):
        return StepPath(0, f"{ABOVE} {sizes[-1]}")
    return StepPath(sizes[i])
