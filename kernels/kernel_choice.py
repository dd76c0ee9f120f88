"""Which of several implementations of the same math runs, decided by timing them on first
use on this machine, then kept in the per-machine cache (kernels.kernel_cache).

A decision is named by what it depends on (op, dtype, shape, row bucket, threads: see
kernels.cpu_linear); the first call that needs it runs every candidate on that call's own
inputs, a warm-up call each and then alternating timed rounds until MIN_ROUNDS are done and
BUDGET_S has passed (at most MAX_ROUNDS; from MIN_ROUNDS on, a candidate ELIMINATE times
slower than the leader runs no more), and keeps the candidate with the lowest best time: the
best of several is what survives a neighbour's burst on a shared machine. Each timed call
follows a short busy wait (GAP_S), as in a step, so waking idle threads is part of its time. Only
shapes that actually run are measured, each once per machine. A choice only picks which
implementation runs; each candidate computes the same math (their float rounding orders
are tested against the same references); the one exception, bfloat16 prefill attention over
a bfloat16 pool, says so where it is chosen (kernels.cpu_prefill_attention). The clock is a
parameter so tests drive the chooser with fake timings.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvscope.kernels import kernel_cache

Clock = Callable[[], float]
MIN_ROUNDS = 2
MAX_ROUNDS = 7
ELIMINATE = 2.0
BUDGET_S = 0.03  # per decision, after the warm-up: small shapes get all their rounds
# A busy wait before every timed call, as a step's Python runs between two matmuls: long
# enough for idle OpenMP threads under kvscope's GOMP_SPINCOUNT to fall asleep, so a
# candidate that needs them waking pays for it here as it does in a step (timed back to
# back, a parallel candidate looked faster than it was: docs/threads.md).
GAP_S = 20e-6


@dataclass
class Decision:
    """One choice: the candidates' best times (ms), the winner, and whether this process
    measured it or found it in the cache."""
    name: str
    choice: str
    times_ms: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)
    source: str = "measured"

    def record(self) -> dict[str, Any]:
        """What the cache file keeps (the source is this process's business)."""
        got = asdict(self)
        del got["source"], got["name"]
        return got


class Chooser:
    """Decisions for one machine key, loaded lazily from (and saved to) `path`."""

    def __init__(self, path: Path, key: dict[str, str], clock: Clock = time.perf_counter,
                 budget_s: float = BUDGET_S, gap: Callable[[], None] | None = None) -> None:
        self.path, self.key, self.clock, self.budget_s = path, key, clock, budget_s
        self.gap = gap if gap is not None else (lambda: busy_wait(GAP_S))
        self.decisions: dict[str, Decision] = {}
        self.cache_reason: str | None = None  # why the file was ignored (None: it was not)
        self._fast: dict[Hashable, str] = {}
        self._loaded = False
        # re-entrant: a candidate may make a decision of its own the first time it runs (the
        # one-region step against the kernel-by-kernel one, whose attention has one)
        self._lock = threading.RLock()

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        choices, self.cache_reason = kernel_cache.load(self.path, self.key)
        for name, rec in choices.items():
            times = rec.get("times_ms")
            info = rec.get("info")
            self.decisions[name] = Decision(
                name, rec["choice"], dict(times) if isinstance(times, dict) else {},
                dict(info) if isinstance(info, dict) else {}, "cached")

    def choose(self, name: str, candidates: Mapping[str, Callable[[], object]],
               info: dict[str, Any] | None = None, fast_key: Hashable | None = None) -> str:
        """The candidate to run for decision `name`: from this process's or the file's
        decisions, else measured now (and saved). `fast_key`: a cheap key the caller looks
        the result up by next time (`fast`), instead of building `name` on every call."""
        with self._lock:
            self._load()
            got = self.decisions.get(name)
            if got is None or got.choice not in candidates or _measured_busy_now_quiet(got):
                times = self.measure(candidates)
                # the load average goes with the timings: a choice measured on a busy
                # machine shows as such in `kvscope bench --kernels`
                info = {**(info or {}), "loadavg_1m": _loadavg()}
                got = Decision(name, min(times, key=lambda n: times[n]),
                               {n: t * 1e3 for n, t in times.items()}, info)
                self.decisions[name] = got
                self._save()
            if fast_key is not None:
                self._fast[fast_key] = got.choice
            return got.choice

    def fast(self, fast_key: Hashable) -> str | None:
        """A choice made earlier in this process under `fast_key` (None: ask `choose`)."""
        return self._fast.get(fast_key)

    def measure(self, candidates: Mapping[str, Callable[[], object]]) -> dict[str, float]:
        """Each candidate's best time in seconds."""
        if not candidates:
            raise ValueError("a kernel choice needs at least one candidate")
        names = list(candidates)
        for n in names:  # warm-up: one-time costs (primitive creation, first touch of pages)
            candidates[n]()
        best = dict.fromkeys(names, math.inf)
        start, rounds = self.clock(), 0
        while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS
                                      and self.clock() - start < self.budget_s):
            for n in names if rounds % 2 == 0 else names[::-1]:  # neither always goes first
                self.gap()
                t0 = self.clock()
                candidates[n]()
                best[n] = min(best[n], self.clock() - t0)
            rounds += 1
            if rounds >= MIN_ROUNDS:  # (not before: one burst must not put a candidate out)
                # ELIMINATE x the leader's best is out: the rounds that remain go to close
                # calls (a big weight's call costs milliseconds)
                lead = min(best.values())
                names = [n for n in names if best[n] <= ELIMINATE * lead]
        return best

    def _save(self) -> None:
        # Another process may have saved decisions of its own since this one loaded: keep
        # them (this process's win where both decided the same thing).
        theirs, _ = kernel_cache.load(self.path, self.key, quiet=True)
        merged = {**theirs, **{n: d.record() for n, d in self.decisions.items()}}
        kernel_cache.save(self.path, self.key, merged)

    def forget(self, names: list[str]) -> None:
        """Drop these decisions (in this process; the file on the next save), so their next
        use measures them again."""
        with self._lock:
            self._load()
            for n in names:
                self.decisions.pop(n, None)
            self._fast.clear()

    def decision(self, name: str) -> Decision | None:
        """The decision made (or cached) under `name`, with its times."""
        with self._lock:
            self._load()
            return self.decisions.get(name)

    def table(self) -> list[Decision]:
        with self._lock:
            self._load()
            return sorted(self.decisions.values(), key=lambda d: d.name)


def thread_wait() -> str:
    """How this process's idle OpenMP threads wait (as libgomp read it when torch loaded):
    part of every decision's name, since it decides what waking them costs, so a choice made
    under libgomp's spinning is not taken under kvscope's short spin (docs/threads.md)."""
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if spin:
        return f"spin={spin}"
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    return policy if policy in ("active", "passive") else "spin=default"


def threads_name(threads: int) -> str:
    """The part of a decision's name for how it runs in parallel: "threads=2 wait=spin=1000"."""
    return f"threads={threads} wait={thread_wait()}"


def busy_wait(seconds: float) -> None:
    """The Python between two matmuls of a step: a busy thread, not a sleeping one."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _busy(load: object) -> bool:
    """A 1-minute load average above the CPU count: other work was taking the cores, so
    timings taken then say more about that work than about the kernels."""
    return isinstance(load, (int, float)) and load > (os.cpu_count() or 1)


def _measured_busy_now_quiet(got: Decision) -> bool:
    """A cached choice measured on a busy machine is measured again once it is quiet (only
    then: on a machine that stays busy the old choice is as good as a new one)."""
    return (got.source == "cached" and _busy(got.info.get("loadavg_1m"))
            and not _busy(_loadavg()))


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not on every platform
        return None


_default: Chooser | None = None
_default_lock = threading.Lock()


def default() -> Chooser:
    """The process's chooser: this machine's key, the cache file of kernel_cache.cache_path
    (read when the first decision is asked for)."""
    global _default
    with _default_lock:
        if _default is None:
            from kvscope.kernels import machine_key
            _default = Chooser(kernel_cache.cache_path(), machine_key.machine_key())
        return _default


def reset(chooser: Chooser | None = None) -> None:
    """Replace the process's chooser (None: build it afresh on next use, e.g. after
    $KVSCOPE_CACHE_DIR changed)."""
    global _default
    with _default_lock:
        _default = chooser
