"""How the benchmarks time things and print what they found: best-of-N and median timed runs
with a device sync, percentiles, and the `--json`-or-table ending every script closes with.

torch is imported only to sync a CUDA device, so a script that times no tensors (gui_bench,
http_bench) never loads it by using this module.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Clock = Callable[[], float]
JSON_HELP = "print one JSON object on stdout instead of the table"


# -- timing --------------------------------------------------------------------------------
def is_cuda(device: object) -> bool:
    """Whether `device` ("cuda", "cuda:1" or a torch.device) names a CUDA device."""
    return str(device).split(":")[0] == "cuda"


def sync_device(device: object) -> None:
    """Wait for the work queued on `device`: a CUDA kernel launch returns before the kernel
    ends, so a clock read without this would time the launch. Nothing to wait for elsewhere."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize()


def warm_up(fn: Callable[[], object], calls: int, device: object = "cpu") -> None:
    """Untimed calls first (compiling, allocating, filling caches), then wait for them."""
    for _ in range(calls):
        fn()
    sync_device(device)


def per_call_seconds(fn: Callable[[], object], calls: int = 1, *, warmup: int = 1,
                     device: object = "cpu", clock: Clock = time.perf_counter) -> float:
    """Seconds per call of `calls` back-to-back calls of fn, after `warmup` untimed ones;
    the device is synced before the clock stops."""
    warm_up(fn, warmup, device)
    start = clock()
    for _ in range(calls):
        fn()
    sync_device(device)
    return (clock() - start) / calls


def timed_runs(fn: Callable[[], object], runs: int, *, calls: int = 1, warmup: int = 1,
               device: object = "cpu", clock: Clock = time.perf_counter) -> list[float]:
    """Seconds per call of each of `runs` timed runs of `calls` calls, after `warmup` calls."""
    warm_up(fn, warmup, device)
    return [per_call_seconds(fn, calls, warmup=0, device=device, clock=clock)
            for _ in range(runs)]


def best_of(fn: Callable[[], object], runs: int, *, calls: int = 1, warmup: int = 1,
            device: object = "cpu", clock: Clock = time.perf_counter) -> float:
    """The fastest run's seconds per call: the run least disturbed by the rest of the machine."""
    return min(timed_runs(fn, runs, calls=calls, warmup=warmup, device=device, clock=clock))


def median_of(fn: Callable[[], object], runs: int, *, calls: int = 1, warmup: int = 1,
              device: object = "cpu", clock: Clock = time.perf_counter) -> float:
    """The median run's seconds per call: steadier than the best when runs vary a lot."""
    return statistics.median(timed_runs(fn, runs, calls=calls, warmup=warmup, device=device,
                                        clock=clock))


def calls_lasting(fn: Callable[[], object], min_seconds: float, *, warmup: int = 1,
                  device: object = "cpu", clock: Clock = time.perf_counter) -> int:
    """The fewest back-to-back calls, a power of two, that take at least `min_seconds`: a run
    that long is not lost in the clock's resolution or a call's launch cost."""
    warm_up(fn, warmup, device)
    calls = 1
    while per_call_seconds(fn, calls, warmup=0, device=device, clock=clock) * calls < min_seconds:
        calls *= 2
    return calls


def percentile(xs: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank value below which `fraction` (0.95: p95) of xs lie; None for no xs."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# -- the ending ----------------------------------------------------------------------------
def add_json_flag(parser: argparse._ActionsContainer, help_text: str = JSON_HELP) -> None:
    """The `--json` flag every benchmark takes (args.json), on a parser or an option group."""
    parser.add_argument("--json", action="store_true", help=help_text)


def progress_logger(name: str) -> Callable[[str], None]:
    """A function printing "[name] message" lines on stderr, flushed at once: progress for
    whoever watches, kept off stdout, which --json leaves to the result alone."""

    def log(message: str) -> None:
        print(f"[{name}] {message}", file=sys.stderr, flush=True)

    return log


def print_result(result: Any, table: Callable[[Any], str], as_json: bool, *,
                 table_to_stderr: bool = False, indent: int | None = None) -> None:
    """With `as_json`, `result` as one JSON document on stdout, so stdout parses whole, and
    with `table_to_stderr` the table on stderr for whoever watches; else the table on stdout
    (nothing for an empty table)."""
    if as_json:
        if table_to_stderr:
            print(table(result), file=sys.stderr)
        print(json.dumps(result, indent=indent))
        return
    text = table(result)
    if text:
        print(text)


def run_benchmark(argv: list[str] | None, parse: Callable[[list[str]], Any],
                  run: Callable[[Any], Any], table: Callable[[Any], str]) -> int:
    """A benchmark's `main`: parse argv (the command line's when None), run, print the
    table or, with --json, the result."""
    args = parse(sys.argv[1:] if argv is None else argv)
    print_result(run(args), table, args.json)
    return 0
