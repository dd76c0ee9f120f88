"""Microseconds per call of the int4 matmul implementations as a decode step calls them:
weights cold, a gap between calls.

    python -m benchmarks.cpu.int4_in_step [--rows 1 4 16] [--layers 30] [--gap-us 20]
        [--threads 2] [--rounds 8] [--json]

The kernel chooser (kernels/kernel_choice.py) times each candidate on one weight, call after
call: the weight stays in cache and torch's OpenMP threads never fall asleep. A decode step
reads every layer's weights once (from memory) and runs a few microseconds of Python between
two matmuls, long enough for threads under kvscope's GOMP_SPINCOUNT to sleep and need waking.
Here each of SmolLM2's four matmul shapes has --layers random int4 weights, called in a step's
order with a --gap-us busy wait before every timed call, a 64 MiB buffer rewritten before
each round, and each implementation (native on the OpenMP threads, native on the calling
thread, torch's `_weight_int4pack_mm_for_cpu`) keeps the median of its calls.

`import kvscope` comes first, so OpenMP waits as kvscope sets it (docs/threads.md); set
KVSCOPE_OMP_WAIT=as-is to time libgomp's own spinning.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import kvscope  # noqa: F401 - first: it sets how OpenMP waits before torch loads
from kvscope.engine.measure.timing import add_json_flag, print_result

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down


def weights(layers: int) -> list[list[tuple[object, object]]]:
    import torch

    from kvscope.engine.model.weight_formats import quantize_int4

    got = []
    for _ in range(layers):
        row = []
        for n, k in SHAPES:
            codes, scale_zero = quantize_int4(torch.randn(n, k) / k ** 0.5)
            row.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                        scale_zero.to(torch.bfloat16)))
        got.append(row)
    return got


def measure(rows: int, layers: list, gap_s: float, rounds: int) -> dict[str, dict[str, float]]:
    """{implementation: {"NxK": median us}} for `rows` input rows."""
    import torch

    from kvscope.kernels import cpu_int4, kernel_choice

    impls = {"native": lambda x, p, s: cpu_int4.native_int4(x, p, s),
             "native-serial": lambda x, p, s: cpu_int4.native_int4(x, p, s, parallel=False),
             "torch": cpu_int4.torch_int4}
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
    evict = torch.empty(64 * 1024 * 1024 // 4)
    times: dict[tuple[str, int], list[float]] = {(n, i): [] for n in impls
                                                 for i in range(len(SHAPES))}
    for r in range(rounds):
        for name in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
            evict.add_(1)
            for layer in layers:
                for i, (packed, scale_zero) in enumerate(layer):
                    kernel_choice.busy_wait(gap_s)
                    t0 = time.perf_counter()
                    impls[name](xs[SHAPES[i][1]], packed, scale_zero)
                    times[(name, i)].append(time.perf_counter() - t0)
    return {name: {f"{n}x{k}": statistics.median(times[(name, i)]) * 1e6
                   for i, (n, k) in enumerate(SHAPES)} for name in impls}


def format_table(result: dict) -> str:
    lines = [f"int4 matmul, us per call: {result['layers']} cold layers, {result['gap_us']} us "
             f"busy gap, {result['threads']} threads, OpenMP wait {result['wait']}",
             f"{'rows':>4} {'shape':>9} {'native':>8} {'native-serial':>14} {'torch':>8}"]
    for rows, got in result["rows"].items():
        for shape in got["native"]:
            lines.append(f"{rows:>4} {shape:>9} {got['native'][shape]:8.1f} "
                         f"{got['native-serial'][shape]:14.1f} {got['torch'][shape]:8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu.int4_in_step",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--gap-us", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    add_json_flag(p)
    args = p.parse_args(argv)
    import torch

    from kvscope.kernels import kernel_choice, native

    if not native.available():
        print("int4_in_step: the native CPU kernels are not available here", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    layers = weights(args.layers)
    result = {"layers": args.layers, "gap_us": args.gap_us, "threads": torch.get_num_threads(),
              "wait": kernel_choice.thread_wait(),
              "rows": {m: measure(m, layers, args.gap_us * 1e-6, args.rounds)
                       for m in args.rows}}
    print_result(result, format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
