"""`kvscope fragsim`: reserved-max-length vs paged KV waste for a length distribution or a trace."""
from __future__ import annotations

import argparse
import json
import sys

from kvscope.kvmath.fragsim import random_lengths, simulate


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `fragsim` and its options on the launcher's subparsers action."""
    p = sub.add_parser("fragsim", help="reserved-max-length vs paged KV waste experiment",
                       description="Reserved-max-length vs paged KV allocation waste")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--min-len", type=int, default=50)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--trace", help="take the request lengths (prompt + output) from a kvscope "
                                   "or Mooncake-style trace instead")
    p.add_argument("--json", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.trace:
            from kvscope.engine.traces.workload import request_lengths
            from kvscope.ipc.trace_format import TraceError

            try:
                lengths = request_lengths(args.trace)
            except TraceError as exc:
                raise ValueError(str(exc)) from exc
            result = simulate(lengths, args.block_size)
        else:
            lengths = random_lengths(args.requests, args.min_len, args.max_len, args.seed)
            result = simulate(lengths, args.block_size, args.max_len)
    except (ValueError, OSError) as exc:
        print(f"kvscope fragsim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(f"{result.requests} requests, max length {result.max_len}, "
          f"block size {result.block_size}")
    print(f"reserved (max length per request): {result.reserved_slots:,} slots, "
          f"{result.reserved_waste * 100:.1f} % reserved waste")
    print(f"paged (blocks of {result.block_size}): {result.paged_slots:,} slots, "
          f"{result.paged_waste * 100:.1f} % paged waste")
    print(f"reserved allocates {result.ratio:.1f}x the slots paged does")
    return 0
