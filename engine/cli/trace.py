"""`kvscope trace replay|compare|export`: replay a session against another configuration,
compare two runs, and export a trace to Chrome trace-event JSON (ui.perfetto.dev).

This module parses arguments and prints; the work is in kvscope.engine.traces. Importing it
does not import torch (the launcher builds every command's parser for --help)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvscope.engine.cli.options import add_engine_options, engine_config_from_args
from kvscope.engine.traces.compare import compare_traces
from kvscope.engine.traces.export_csv import write_csv
from kvscope.engine.traces.export_perfetto import write_chrome
from kvscope.ipc.trace_format import TraceError, read_trace


# -- printing ------------------------------------------------------------------------------
def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def print_summary(s: dict[str, Any]) -> None:
    for k, v in s.items():
        print(f"{k:>20}: {_fmt(v)}")


def print_comparison(result: dict[str, Any]) -> None:
    print(f"{'':>20}  {'A':>12}  {'B':>12}  {'B/A':>8}")
    for k, va in result["a"].items():
        r = result["ratio"].get(k)
        print(f"{k:>20}  {_fmt(va):>12}  {_fmt(result['b'].get(k)):>12}  "
              f"{'' if r is None else f'{r:.3g}x':>8}")


# -- commands ------------------------------------------------------------------------------
def parse_speed(text: str) -> float | None:
    """--speed: a positive factor, or "max" (None: every arrival at once)."""
    if text == "max":
        return None
    try:
        speed = float(text)
    except ValueError:
        speed = 0.0
    if not speed > 0:
        raise ValueError(f"--speed {text} must be a positive number or 'max'")
    return speed


def cmd_replay(args: argparse.Namespace) -> int:
    # Imported here: replaying needs the engine (torch); compare and export do not.
    from kvscope.engine.traces.replay import default_output_path, replay_file

    speed = parse_speed(args.speed)
    out = args.output or default_output_path(args.trace)
    result = replay_file(args.trace, out, engine_config_from_args(args), speed,
                         include_prompts=not args.no_prompts, prompt_seed=args.prompt_seed,
                         hash_block_size=args.hash_block_size).as_dict()
    if args.json:
        print(json.dumps(result))
    else:
        print_summary(result)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    result = compare_traces(read_trace(args.a), read_trace(args.b)).as_dict()
    if args.json:
        print(json.dumps(result))
    else:
        print_comparison(result)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    write_chrome(trace, args.output)
    if args.csv:
        write_csv(trace, args.csv)
    print(f"wrote {args.output}" + (f" and {args.csv}" if args.csv else ""))
    return 0


HANDLERS = {"replay": cmd_replay, "compare": cmd_compare, "export": cmd_export}
DESCRIPTION = ("Replay a recorded session against another configuration, compare two runs, and "
               "export a trace to Chrome trace-event JSON (ui.perfetto.dev).")


# -- command line --------------------------------------------------------------------------
def _add_replay(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("replay", help="replay a trace's arrivals against an engine config")
    r.add_argument("trace", help="a kvscope trace, or Mooncake-style JSONL")
    r.add_argument("--speed", default="1.0",
                   help="scale the inter-arrival times (2 = twice as fast), or 'max'")
    r.add_argument("-o", "--output", help="the new trace (default TRACE.replay.jsonl)")
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-prompts", action="store_true",
                   help="record prompt lengths only in the new trace")
    r.add_argument("--prompt-seed", type=int, default=0,
                   help="seed for prompts synthesised where the trace has none")
    r.add_argument("--hash-block-size", type=int, default=512,
                   help="tokens per Mooncake hash id (default 512)")
    add_engine_options(r)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compare", help="two traces' summaries side by side")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json", action="store_true")


def _add_export(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="Chrome trace-event JSON for ui.perfetto.dev")
    e.add_argument("trace")
    e.add_argument("-o", "--output", required=True)
    e.add_argument("--csv", help="also write the per-step series as CSV")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `trace` and its subcommands on a subparsers action."""
    p = sub.add_parser("trace", help="replay, compare and export recorded session traces",
                       description=DESCRIPTION)
    commands = p.add_subparsers(dest="trace_command", required=True)
    _add_replay(commands)
    _add_compare(commands)
    _add_export(commands)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        return HANDLERS[args.trace_command](args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"kvscope trace {args.trace_command}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str]) -> int:
    """`kvscope trace ARGV...` on a parser of its own (until the launcher calls add_parser)."""
    parser = argparse.ArgumentParser(prog="kvscope")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["trace", *argv]))
