"""Where `kv-accuracy` keeps its last long-context run: the user's data folder.

$XDG_DATA_HOME/kvscope/kv-accuracy/last-<task>.json, else ~/.local/share/kvscope/...: the
folder the engine keeps its traces in (engine/server/trace_paths.py). The window reads the
passkey one (app/kv_grid/saved_grid.py computes the same path: the app may not import this).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvscope" / "kv-accuracy"


def last_run_path(task: str) -> Path:
    return data_dir() / f"last-{task}.json"


def save(result: dict, path: Path) -> Path:
    """Write atomically (a temporary file renamed over the old one): a window reading the
    file while a run ends sees the old grid or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return path
