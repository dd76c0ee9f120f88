"""`kvscope trace replay|compare|export`: replay a session against another configuration or
any OpenAI-compatible server (--url), compare runs, and export a trace to Chrome trace-event
JSON (ui.perfetto.dev).

This module parses arguments and prints; the work is in kvscope.engine.traces. Importing it
does not import torch (the launcher builds every command's parser for --help)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvscope.engine.cli.options import add_engine_options, engine_config_from_args
from kvscope.engine.traces.compare import compare_runs, compare_traces, parse_slo
from kvscope.engine.traces.compare_report import as_markdown, as_text
from kvscope.engine.traces.export_csv import write_csv
from kvscope.engine.traces.export_perfetto import write_chrome
from kvscope.engine.traces.requests import load_run
from kvscope.ipc.trace_format import TraceError, read_trace


# -- printing ------------------------------------------------------------------------------
def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def print_summary(s: dict[str, Any]) -> None:
    for k, v in s.items():
        print(f"{k:>20}: {_fmt(v)}")


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
    if args.url:
        from kvscope.engine.cli.trace_url import cmd_replay_url

        return cmd_replay_url(args, parse_speed(args.speed))
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


def _legacy(paths: list[str]) -> dict[str, Any]:
    """Two kvscope-format traces' summaries and ratios (the keys the JSON had before)."""
    if len(paths) != 2:
        return {}
    try:
        return compare_traces(read_trace(paths[0]), read_trace(paths[1])).as_dict()
    except TraceError:  # a Mooncake workload: no summary
        return {}


def cmd_compare(args: argparse.Namespace) -> int:
    paths = [args.a, args.b, *args.more]
    slo = parse_slo(args.slo) if args.slo else None
    decode = None
    if args.tokenizer:
        from kvscope.engine.traces.text import load_text_tokenizer

        decode = load_text_tokenizer(args.tokenizer).decode
    result = compare_runs([load_run(p) for p in paths], slo, args.allow_mismatch, decode)
    if args.json:
        print(json.dumps({**_legacy(paths), **result.as_dict()}))
    elif args.markdown:
        print(as_markdown(result))
    else:
        print(as_text(result))
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
    _add_url_options(r)
    add_engine_options(r)


def _add_url_options(r: argparse.ArgumentParser) -> None:
    # --model is the engine option's: with --url it names the served model to ask for
    # (left at "default": the first one /v1/models lists).
    u = r.add_argument_group("replay against an OpenAI-compatible server (--url; --model "
                             "NAME then names the served model, default the first listed)")
    u.add_argument("--url", help="the server's API base, e.g. http://127.0.0.1:8000/v1 "
                                 "(vLLM, SGLang, llama-server, Ollama /v1, kvscope serve)")
    u.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as Authorization: Bearer KEY (default $OPENAI_API_KEY)")
    api = u.add_mutually_exclusive_group()
    api.add_argument("--completions", dest="api", action="store_const", const="completions",
                     help="POST /v1/completions with token-id prompts (the default)")
    api.add_argument("--chat", dest="api", action="store_const", const="chat",
                     help="POST /v1/chat/completions, prompts decoded to text (--tokenizer)")
    u.add_argument("--max-concurrency", type=int, metavar="N", default=16,
                   help="requests in flight at most (default 16)")
    u.add_argument("--ignore-eos", action="store_true",
                   help="ask for the recorded output lengths exactly (ignore_eos + max_tokens)")
    u.add_argument("--timeout-s", type=float, metavar="S", default=600.0,
                   help="the whole run's limit in seconds (default 600)")
    u.add_argument("--request-timeout-s", type=float, metavar="S", default=300.0,
                   help="one request's limit in seconds (default 300)")
    u.add_argument("--tokenizer", metavar="MODEL",
                   help="a kvscope model spec whose tokenizer decodes prompts (--chat) and "
                        "recorded outputs (default: the trace's)")
    u.add_argument("--vocab-size", type=int, metavar="N",
                   help="token ids to synthesise prompts from, without a tokenizer")
    u.add_argument("--progress", action="store_true",
                   help="a JSON progress line on stderr as each request ends")


def _add_compare(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compare", help="runs side by side: throughput, TTFT, TPOT, ITL, E2E",
                       description="Compare runs of the same requests: kvscope traces, "
                                   "replays against external servers (replay --url), "
                                   "Mooncake-style workloads. The first run is the baseline.")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("more", nargs="*", metavar="C", help="more runs")
    out = c.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--markdown", action="store_true")
    c.add_argument("--slo", help="goodput bounds, e.g. ttft=500ms,tpot=50ms[,e2e=2s]")
    c.add_argument("--allow-mismatch", action="store_true",
                   help="compare runs of different request sets (on the shared requests)")
    c.add_argument("--tokenizer", metavar="MODEL",
                   help="decode token ids to compare them with another run's text (a kvscope "
                        "model spec, e.g. default)")


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
