"""`kvscope`: the window by default, benchmarks by name, every other command to the engine's CLI.

The desktop app runs in a process without torch (it starts or attaches to an engine process of
its own), so the GUI route imports only app/.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"bench": "kvscope.benchmarks.bench", "kv-accuracy": "kvscope.benchmarks.kv_accuracy"}
LIGHT = {"keys": "kvscope.keys"}  # commands that load neither torch nor Qt


def wants_gui(argv: list[str]) -> bool:
    return (not argv or argv[0] == "gui"
            or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_gui(argv):
        from kvscope.app.main import main as gui_main

        return gui_main(argv[1:] if argv[:1] == ["gui"] else argv)
    if argv[0] in BENCHMARKS or argv[0] in LIGHT:
        module = BENCHMARKS.get(argv[0]) or LIGHT[argv[0]]
        return importlib.import_module(module).main(argv[1:])
    from kvscope.engine.cli.main import main as engine_main

    return engine_main(argv)


if __name__ == "__main__":
    sys.exit(main())
