"""The engine's command dispatcher: generate and kv-calc here, serve/trace/fragsim in their own
modules (they own their options, so they get the raw argv)."""
from __future__ import annotations

import argparse
import importlib
import sys

from kvscope.engine.cli import generate, kv_calc

# argparse REMAINDER would not pass options that start with "--" through, so these get argv.
DELEGATED = {"serve": "kvscope.engine.cli.serve", "trace": "kvscope.engine.cli.trace",
             "fragsim": "kvscope.engine.cli.fragsim"}
# Run by the launcher (kvscope/main.py); listed here so that --help names every command.
ELSEWHERE = {"bench": "engine vs Hugging Face generate on a mixed workload",
             "kv-accuracy": "accuracy of each KV dtype against float32 KV",
             "gui": "the desktop app (the default with no command; --attach URL)",
             "keys": "CURVE keys for remote attach: init, show, allow, trust"}
HELP = {"serve": "headless engine process behind ZeroMQ",
        "trace": "replay, compare and export recorded session traces",
        "fragsim": "reserved-max-length vs paged KV waste experiment"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope", description="See and steer what a local LLM engine does with its KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    for name, text in {**HELP, **ELSEWHERE}.items():
        sub.add_parser(name, help=text)
    kv_calc.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "kv-calc":
        return kv_calc.run(args)
    if args.command == "generate":
        return generate.run(args)
    print(f"kvscope: {args.command!r} is run by the `kvscope` launcher", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
