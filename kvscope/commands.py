"""The table of `kvscope` commands: the one place a command is named, described and located.

Each row names the module that implements the command as a dotted string; the launcher
(kvscope/main.py) imports it only when that command runs, so `kvscope --help` lists every
command without loading any of them. A command module provides
`add_parser(sub) -> argparse.ArgumentParser` (registers its subparser, with this row's name and
help, on an argparse subparsers action) and `run(args: argparse.Namespace) -> int`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str  # what the user types after `kvscope`
    module: str  # dotted name of the module with add_parser(sub) and run(args)
    help: str  # the one line `kvscope --help` shows
    needs_torch: bool  # False: the command must start without importing torch


COMMANDS: tuple[Command, ...] = (
    Command("gui", "kvscope.app.main",
            "the desktop app (the default with no command; --attach URL)", needs_torch=False),
    Command("serve", "kvscope.engine.cli.serve",
            "headless engine process behind ZeroMQ", needs_torch=True),
    Command("generate", "kvscope.engine.cli.generate",
            "generate a reply, streamed to stdout", needs_torch=True),
    Command("kv-calc", "kvscope.engine.cli.kv_calc",
            "KV bytes per token and in total for a model config", needs_torch=False),
    Command("trace", "kvscope.engine.cli.trace",
            "replay, compare and export recorded session traces", needs_torch=True),
    Command("fragsim", "kvscope.engine.cli.fragsim",
            "reserved-max-length vs paged KV waste experiment", needs_torch=False),
    Command("keys", "kvscope.keys",
            "CURVE keys for remote attach: init, show, allow, trust", needs_torch=False),
    Command("bench", "kvscope.engine.cli.bench",
            "engine vs Hugging Face generate on a mixed workload", needs_torch=True),
    Command("kv-accuracy", "kvscope.engine.cli.kv_accuracy",
            "accuracy of each KV dtype against float32 KV", needs_torch=True),
)

# With no command, or with an option first (`kvscope --attach URL`), kvscope runs this one.
DEFAULT = "gui"


def find(name: str) -> Command | None:
    """The row named `name`, or None when no command has that name."""
    return next((c for c in COMMANDS if c.name == name), None)
