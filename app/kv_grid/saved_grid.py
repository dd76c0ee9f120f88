"""The last saved passkey grid, read and checked: what the heatmaps show.

`kvscope kv-accuracy --task passkey` saves its run to the user's data folder
($XDG_DATA_HOME/kvscope/kv-accuracy/last-passkey.json, else ~/.local/share/...): the same
path as benchmarks/saved_results.py, computed here because the window may not import it. A
file that is not such a grid is refused with a message that says what was wrong; the window
then shows the message instead of a grid.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


class GridError(ValueError):
    pass


def saved_path(task: str = "passkey") -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvscope" / "kv-accuracy" / f"last-{task}.json"


@dataclass(frozen=True)
class Cell:
    length: int
    depth: float
    right: float | None  # share of the cell's keys found
    same: float  # share answered as float32 KV answered
    kl: float
    rank: float


@dataclass(frozen=True)
class SettingGrid:
    name: str
    kv_dtype: str
    kv_rotation: str
    kv_anchor_tokens: int
    cells: list[Cell]


@dataclass(frozen=True)
class SavedGrid:
    model: str
    date: str
    seconds: float
    lengths: list[int]
    depths: list[float]
    settings: list[SettingGrid]
    partial: bool = False  # a run cut short: only the settings it finished

    def setting(self, name: str) -> SettingGrid | None:
        return next((s for s in self.settings if s.name == name), None)

    def for_dtype(self, dtype: str) -> list[SettingGrid]:
        return [s for s in self.settings if s.kv_dtype == dtype]


def parse(data: object) -> SavedGrid:
    """A SavedGrid from a decoded JSON document, or GridError naming what is wrong."""
    if not isinstance(data, dict):
        raise GridError("not a JSON object")
    if data.get("task") != "passkey":
        raise GridError(f"task is {data.get('task')!r}, not 'passkey'")
    settings = data.get("settings")
    if not isinstance(settings, dict) or not settings:
        raise GridError("no settings")
    try:
        grids = [_setting(name, s) for name, s in settings.items()]
        lengths = sorted({c.length for g in grids for c in g.cells})
        depths = sorted({c.depth for g in grids for c in g.cells})
        return SavedGrid(model=str(data["model"]), date=str(data["date"]),
                         seconds=float(data.get("seconds", 0.0)), lengths=lengths,
                         depths=depths, settings=grids, partial=bool(data.get("partial")))
    except (KeyError, TypeError, ValueError) as exc:
        raise GridError(f"malformed grid: {type(exc).__name__} {exc}") from None


def _setting(name: str, s: dict) -> SettingGrid:
    cells = [Cell(length=int(c["length"]), depth=float(c["depth"]),
                  right=None if c.get("right") is None else float(c["right"]),
                  same=float(c["same_as_float32"]), kl=float(c["kl"]), rank=float(c["rank"]))
             for c in s["cells"]]
    if not cells:
        raise ValueError(f"setting {name} has no cells")
    return SettingGrid(name=str(name), kv_dtype=str(s["kv_dtype"]),
                       kv_rotation=str(s["kv_rotation"]),
                       kv_anchor_tokens=int(s["kv_anchor_tokens"]), cells=cells)


def load(path: Path | None = None) -> tuple[SavedGrid | None, str]:
    """(grid, "") or (None, why there is none): never raises for a missing or bad file."""
    path = path or saved_path()
    if not path.exists():
        return None, ("no long-context grid measured yet: press Measure, or run "
                      "`kvscope kv-accuracy --task passkey`")
    try:
        return parse(json.loads(path.read_text())), ""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, GridError) as exc:
        return None, f"ignored the saved grid {path}: {exc}"
