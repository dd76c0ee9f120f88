"""How OpenMP's idle threads wait, against decode step time, quiet and beside a busy neighbour.

    python -m kvscope.benchmarks.omp_wait [--streams 1 16] [--steps 20] [--json]

The native kernels and torch share one OpenMP runtime (torch's libgomp). Between two parallel
regions its threads spin (GOMP_SPINCOUNT, 300,000 rounds by default when OMP_WAIT_POLICY is
unset) before they sleep. A decode step is hundreds of short regions, so spinning saves a
wake-up each; but when another process wants a core (the window beside its engine, a build,
a browser) a spinning thread holds it while the thread the region waits for cannot run.

Each setting runs in a fresh engine process (libgomp reads the variables once, when it
loads): --streams requests decode, and the median of --steps timed steps after their prefill
is the step time; first on a quiet machine, then beside a neighbour process that keeps one
core busy. The table is ms per step and, per setting, its time against the best setting's.
kvscope/__init__.py sets the default it picks (docs/threads.md has the measurements).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from kvscope.benchmarks.timing import add_json_flag, print_result, progress_logger

log = progress_logger("omp-wait")
# (name, environment): "default" is libgomp's own (kvscope's default is unset for it)
SETTINGS = (("spin 300000 (libgomp default)", {"GOMP_SPINCOUNT": "300000"}),
            ("spin 10000", {"GOMP_SPINCOUNT": "10000"}),
            ("spin 1000", {"GOMP_SPINCOUNT": "1000"}),
            ("passive", {"OMP_WAIT_POLICY": "passive"}))
NEIGHBOUR = "import time\nwhile True:\n    pass\n"


def child(streams: int, steps: int) -> float:
    """Median decode step time (s) of `streams` requests on the embedded model."""
    import random

    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="default", device="cpu", max_num_seqs=streams,
                                    enable_prefix_caching=False, max_model_len=1024))
    rng = random.Random(0)
    for _ in range(streams):
        engine.add_request([rng.randrange(1000, 20000) for _ in range(100)],
                           SamplingParams(max_tokens=100_000, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < len(s.prompt_token_ids)
                               for s in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_child(env: dict[str, str], streams: int, steps: int) -> float:
    full = {k: v for k, v in os.environ.items()
            if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    full.update(env)
    full["KVSCOPE_OMP_WAIT"] = "as-is"  # kvscope/__init__.py leaves the variables alone
    out = subprocess.run([sys.executable, "-m", "kvscope.benchmarks.omp_wait", "--child",
                          str(streams), str(steps)], env=full, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict:
    rows = []
    for loaded in (False, True):
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if loaded else None
        try:
            for name, env in SETTINGS:
                for n in args.streams:
                    ms = 1e3 * run_child(env, n, args.steps)
                    log(f"{'neighbour' if loaded else 'quiet'}, {name}, {n} streams: "
                        f"{ms:.1f} ms")
                    rows.append({"neighbour": loaded, "setting": name, "streams": n,
                                 "ms": ms})
        finally:
            if neighbour is not None:
                neighbour.kill()
    return {"rows": rows, "load_note": "one neighbour process keeps a core busy"}


def format_table(result: dict) -> str:
    lines = ["ms per decode step (x: against the best setting of that column)",
             f"{'setting':<30} " + "  ".join(
                 f"{('busy ' if b else 'quiet ') + str(n) + ' st':>16}"
                 for b in (False, True) for n in sorted({r['streams'] for r in result['rows']}))]
    rows = result["rows"]
    columns = [(b, n) for b in (False, True) for n in sorted({r["streams"] for r in rows})]
    best = {c: min(r["ms"] for r in rows if (r["neighbour"], r["streams"]) == c)
            for c in columns}
    for name, _ in SETTINGS:
        cells = []
        for c in columns:
            ms = next(r["ms"] for r in rows if (r["neighbour"], r["streams"], r["setting"])
                      == (*c, name))
            cells.append(f"{ms:>8.1f} {ms / best[c]:>5.2f}x")
        lines.append(f"{name:<30} " + "  ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(child(int(argv[1]), int(argv[2])))
        return 0
    p = argparse.ArgumentParser(prog="kvscope.benchmarks.omp_wait", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=20)
    add_json_flag(p)
    args = p.parse_args(argv)
    result = measure(args)
    print_result(result, format_table, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

