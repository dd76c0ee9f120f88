"""The native CPU decode attention (kernels/cpu_decode_attention.c) per KV storage dtype: one
layer's call for a batch of decode rows, best of five runs of --reps calls each, all dtypes in
one process so they share the machine's state.

    python -m kvscope.benchmarks.cpu_attention_dtypes [--seqs 16] [--context 160] [--threads 2]

The shape is SmolLM2's (9 query heads, 3 KV heads, head_dim 64), block size 16.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

CASES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
         ("int8", "float32"), ("int8", "bfloat16"), ("fp8", "float32"))


def time_call(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cpu_attention_dtypes", description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--json", action="store_true")
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
        rows[f"{kv} pool, {q} query"] = time_call(call, args.reps) * 1e6
    if args.json:
        print(json.dumps({"us_per_call": rows, **vars(args)}))
    else:
        for name, us in rows.items():
            print(f"{name:28} {us:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
