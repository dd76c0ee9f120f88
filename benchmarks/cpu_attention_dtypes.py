"""Microseconds per call of the native CPU decode attention for each KV storage dtype.

    python -m kvscope.benchmarks.cpu_attention_dtypes [--seqs 16] [--context 160] [--threads 2]
        [--json]

The kernel is kernels/cpu_decode_attention.c: one layer's call for a batch of decode rows, best
of five runs of --reps calls each, all dtypes in one process so they share the machine's state.

The shape is SmolLM2's (9 query heads, 3 KV heads, head_dim 64), block size 16.
"""
from __future__ import annotations

import argparse
import functools
import sys

from kvscope.benchmarks.timing import add_json_flag, best_of, print_result

CASES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
         ("int8", "float32"), ("int8", "bfloat16"), ("fp8", "float32"))


def format_table(result: dict) -> str:
    return "\n".join(f"{name:28} {us:8.1f} us" for name, us in result["us_per_call"].items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpu_attention_dtypes", description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    add_json_flag(p)
    args = p.parse_args(argv)
    import torch

    from kvscope.kernels import cpu_attention
    from kvscope.kernels.quant import quantize
    from kvscope.testing.pools import build_batch

    torch.set_num_threads(args.threads)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    query, kc, vc, meta, _ = build_batch([1] * args.seqs, [args.context] * args.seqs, 16, 9, 3,
                                         64, num_blocks=args.seqs * (args.context // 16 + 2),
                                         seed=1)
    rows = {}
    for kv, q in CASES:
        dt = dtypes[kv]
        if dt in (torch.int8, torch.float8_e4m3fn):
            (k, ks), (v, vs) = quantize(kc, dt), quantize(vc, dt)
        else:
            k, v, ks, vs = kc.to(dt), vc.to(dt), None, None
        qq = query.to(dtypes[q])
        call = functools.partial(cpu_attention.paged_attention_cpu, qq, k, v, meta, 0.125,
                                 ks, vs)
        rows[f"{kv} pool, {q} query"] = best_of(call, 5, calls=args.reps, warmup=10) * 1e6
    print_result({"us_per_call": rows, **vars(args)}, format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
