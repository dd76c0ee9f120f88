"""Where a trace command from the wire may write: only under the folder the server named at start.

A socket is untrusted input whatever the auth mode, so `trace_start` never gets to pick an
arbitrary path on the engine's machine: relative paths land in the trace folder, absolute ones
must resolve (symlinks followed) to a file inside it.
"""
from __future__ import annotations

import os
from pathlib import Path


def default_trace_dir() -> Path:
    """$XDG_DATA_HOME/kvscope/traces, or ~/.local/share/kvscope/traces."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvscope" / "traces"


def prepare_trace_dir(folder: str | os.PathLike | None) -> Path:
    """The resolved trace folder, created (0700) if missing."""
    path = Path(folder).expanduser() if folder else default_trace_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path.resolve()


def trace_path_under(trace_dir: Path, requested: str) -> Path:
    """The file requested names inside trace_dir; ValueError (naming both) if it is outside."""
    if not requested or "\x00" in requested:
        raise ValueError("the trace path is empty or not a path")
    path = (trace_dir / requested).resolve()  # no ~: the engine user's home is not the point
    if path == trace_dir or not path.is_relative_to(trace_dir):
        raise ValueError(f"{requested} is outside the engine's trace folder {trace_dir}: "
                         f"traces are recorded there only (kvscope serve --trace-dir DIR)")
    return path
