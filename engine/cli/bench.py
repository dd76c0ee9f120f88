"""`kvscope bench`: its options, and which measurement they run (engine/measure/).

    kvscope bench [--quick] [--json] [--profile] [--concurrency N] [engine options]
    kvscope bench --kernels [--remeasure-kernels] [engine options]
    kvscope bench --long-context [engine/measure/long_context.py options]
    kvscope bench --sizes [engine/measure/sizes.py options]
    make bench

The workload, the Hugging Face baseline and the report are engine/measure/bench.py's; this
module parses the options, builds the engine config from them and prints what comes back.
"""
from __future__ import annotations

import argparse
import sys

from kvscope.engine.cli.options import add_engine_options, engine_config_from_args
from kvscope.engine.measure.bench import DEFAULT_WORKLOAD, QUICK_WORKLOAD
from kvscope.engine.measure.timing import add_json_flag, print_result


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` and all its options on the launcher's subparsers action."""
    p = sub.add_parser(
        "bench", help="engine vs Hugging Face generate on a mixed workload",
        description="Engine (continuous batching, paged KV) vs Hugging Face generate "
                    "(static batches) on one seeded mixed workload.")
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=None,
                   help=f"number of requests (default {DEFAULT_WORKLOAD[0]}, "
                        f"--quick {QUICK_WORKLOAD[0]})")
    w.add_argument("--min-prompt", type=int, default=None)
    w.add_argument("--max-prompt", type=int, default=None)
    w.add_argument("--min-output", type=int, default=None)
    w.add_argument("--max-output", type=int, default=None)
    w.add_argument("--quick", action="store_true",
                   help="small workload that finishes well under a minute")
    b = p.add_argument_group("baseline and report")
    b.add_argument("--concurrency", type=int, default=16,
                   help="engine max_num_seqs and HF static batch size (default 16); "
                        "replaces --max-num-seqs")
    b.add_argument("--batch-size", type=int, default=None,
                   help="Hugging Face static batch size (default: --concurrency)")
    b.add_argument("--skip-hf", action="store_true", help="run the engine only")
    b.add_argument("--reserve-len", type=int, default=None,
                   help="per-request reservation for kv_waste_reserved "
                        "(default: the engine's max_model_len)")
    b.add_argument("--kernels", action="store_true",
                   help="print the kernel choices for this model's matmuls on this machine "
                        "(measured on first use, cached per machine) and exit")
    b.add_argument("--remeasure-kernels", action="store_true",
                   help="with --kernels: measure the choices again instead of reading them "
                        "from the cache")
    b.add_argument("--long-context", nargs=argparse.REMAINDER, default=None, metavar="OPTION",
                   help="decode and prefill tok/s against context per KV dtype beside "
                        "llama.cpp (engine/measure/long_context.py); the options after it are "
                        "its own")
    b.add_argument("--sizes", nargs=argparse.REMAINDER, default=None, metavar="OPTION",
                   help="kvscope beside llama.cpp at 1-3B shapes (random weights) per weight "
                        "format (engine/measure/sizes.py); the options after it are its own")
    b.add_argument("--profile", action="store_true",
                   help="report where engine step time goes (model forward vs the rest) "
                        "and the host overhead per step")
    add_json_flag(b, "print exactly one JSON object on stdout (table goes to stderr)")
    add_engine_options(p)  # --model --device --dtype --block-size --kv-cache-bytes --seed ...
    p.set_defaults(weights="dense")  # HF reads dense weights: compare like with like
    return p


def run(args: argparse.Namespace) -> int:
    """`kvscope bench`: run the benchmark, print its report; 2 on a bad workload or model."""
    from kvscope.engine.measure import bench

    if args.long_context is not None:
        from kvscope.engine.measure import long_context
        return long_context.main(args.long_context)
    if args.sizes is not None:
        from kvscope.engine.measure import sizes
        return sizes.main(args.sizes)
    if args.kernels:
        return print_kernels(args)
    try:
        bench.resolve_workload_args(args)
        report = bench.run_bench(args, engine_config_from_args(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvscope bench: error: {exc}", file=sys.stderr)
        return 2
    print_result(report, bench.format_table, args.json, table_to_stderr=True)
    return 0


def print_kernels(args: argparse.Namespace) -> int:
    """`--kernels`: load the engine's model as `kvscope bench` would and print its kernel
    choices."""
    from kvscope.engine import LLM
    from kvscope.engine.measure import kernel_table

    args.max_num_seqs = args.concurrency
    llm = LLM(engine_config_from_args(args))
    report = kernel_table.decide(llm.engine.model, args.concurrency, args.remeasure_kernels,
                                 llm.engine.kv_dtype)
    print_result(report, kernel_table.format_kernel_table, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvscope.engine.cli.bench`: the `bench` command alone."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `kvscope bench -- --quick` forwards the separator too
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="kvscope")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["bench", *argv]))


if __name__ == "__main__":
    sys.exit(main())
