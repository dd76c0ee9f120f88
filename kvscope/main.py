"""`kvscope`: runs one command of the table in kvscope/commands.py; the desktop app by default.

`kvscope --help` lists the table without importing any command module; `kvscope X ...` imports
X's module alone, so the window, keys, kv-calc and fragsim start without torch (the desktop app
runs in a process without torch and starts or attaches to an engine process of its own).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from types import ModuleType

from kvscope.commands import COMMANDS, DEFAULT, Command, find

HELP_OPTIONS = ("-h", "--help")
HELP_WORD = "help"  # `kvscope help` lists the commands, `kvscope help X` is `kvscope X --help`
DESCRIPTION = "See and steer what a local LLM engine does with its KV cache."
EPILOG = (f"With no command, or with options only (--attach URL), kvscope runs `kvscope "
          f"{DEFAULT}`.\n`kvscope COMMAND --help` (or `kvscope help COMMAND`) lists its options.")


def root_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `kvscope` parser and the subparsers action a command module adds its parser to."""
    parser = argparse.ArgumentParser(prog="kvscope", description=DESCRIPTION)
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND",
                                required=True)
    return parser, sub


def command_lines() -> str:
    """One line per row of the table: its name, then its help."""
    width = max(len(c.name) for c in COMMANDS)
    return "\n".join(f"  {c.name:<{width}}  {c.help}" for c in COMMANDS)


def listing_parser() -> argparse.ArgumentParser:
    """A parser whose --help lists every command with its line, built from the table alone.
    The lines are laid out here, not by argparse, which would wrap a long name's help."""
    return argparse.ArgumentParser(
        prog="kvscope", usage="kvscope [COMMAND] [options]",
        description=f"{DESCRIPTION}\n\ncommands:\n{command_lines()}", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)


def with_command(argv: list[str]) -> list[str]:
    """argv with a command first: the default one when argv is empty or opens with an option
    other than --help (`kvscope --attach URL` is `kvscope gui --attach URL`)."""
    if not argv or (argv[0].startswith("-") and argv[0] not in HELP_OPTIONS):
        return [DEFAULT, *argv]
    if argv[0] == HELP_WORD and len(argv) > 1:
        return [argv[1], "--help"]
    return argv


def unknown_command(name: str) -> int:
    names = [c.name for c in COMMANDS]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"kvscope: error: unknown command {name!r}{hint}; the commands are: "
          f"{', '.join(names)} (`kvscope --help` says what each does)", file=sys.stderr)
    return 2


def command_module(command: Command) -> ModuleType:
    """The command's module, imported now; it must follow the contract of kvscope/commands.py."""
    module = importlib.import_module(command.module)
    if not all(callable(getattr(module, f, None)) for f in ("add_parser", "run")):
        raise TypeError(f"{command.module} has no add_parser(sub) and run(args), which every "
                        f"module in kvscope/commands.py must have")
    return module


def run_command(command: Command, argv: list[str]) -> int:
    """Parse argv (the command first) with the command's own subparser, then run it."""
    module = command_module(command)
    parser, sub = root_parser()
    module.add_parser(sub)
    if list(sub.choices) != [command.name]:
        raise RuntimeError(f"{command.module}.add_parser registered {list(sub.choices)}, "
                           f"not [{command.name!r}] as kvscope/commands.py says")
    return module.run(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = with_command(sys.argv[1:] if argv is None else list(argv))
    if argv[0] in (*HELP_OPTIONS, HELP_WORD):
        listing_parser().print_help()
        return 0
    command = find(argv[0])
    if command is None:
        return unknown_command(argv[0])
    return run_command(command, argv)


if __name__ == "__main__":
    sys.exit(main())
