"""Interruptible steps: a step of less urgent work gives way to a request that just arrived.

Under the priority policy a step that carries no urgent request (no protected step: nothing
of higher priority was live) runs as big as the budget allows: 70-80 ms of 16 background
streams on 2 cores. A chat that arrives then waits for the whole step before its prompt is
even scheduled; that wait was most of its TTFT p99 under load (docs/scheduling.md). So such
a step is *armed* with the best (lowest) priority it carries; a thread that queues a request
of strictly higher priority (lower number) *offers* it, and the model's layer loop, which
checks between layers, abandons the step. The engine rolls it back (engine.scheduling.roll_back):
no token advanced, the prefix-cache hashes it registered for blocks it never finished are
forgotten, and the next step schedules the newcomer first. What is lost is the part of one step
already run, once per arrival that beats a whole step.

The flag is a C int, so the one-region fused step (engine.model.fused.one_region, one native
call with the GIL released) reads it before each layer too. It lives beside the model, which
polls it; what the scheduler undoes after an abandoned step is engine.scheduling.roll_back.
"""
from __future__ import annotations

import ctypes
import os

# A diagnostic switch, as KVSCOPE_ONE_REGION is: "off" arms no step (benchmarks A/B with it).
ENV = "KVSCOPE_STEP_INTERRUPT"


def interrupts_enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


class StepInterrupted(Exception):
    """Raised in the forward between layers: the armed step was abandoned."""


class StepInterrupt:
    """Shared by the engine thread (arm, disarm, check) and request threads (offer)."""

    def __init__(self) -> None:
        self._armed: int | None = None  # the best priority the running step carries
        self.flag = ctypes.c_int(0)  # 1: abandon the step (native code reads its address)
        self.num_interrupted = 0  # steps abandoned (engine thread only)

    def arm(self, best_priority: int) -> None:
        """The step about to run carries no request better than best_priority."""
        self.flag.value = 0
        self._armed = best_priority

    def disarm(self) -> None:
        self._armed = None
        self.flag.value = 0

    def offer(self, priority: int) -> bool:
        """A request of this priority was queued (any thread): interrupt the running step if
        it carries only less urgent work. True if it asked."""
        armed = self._armed
        if armed is None or priority >= armed:
            return False
        self.flag.value = 1
        return True

    @property
    def armed(self) -> bool:
        return self._armed is not None

    @property
    def requested(self) -> bool:
        return self.flag.value != 0

    def check(self) -> None:
        """Between layers: abandon the step if an urgent request asked."""
        if self.flag.value and self._armed is not None:
            raise StepInterrupted
