"""The last saved passkey grid, as the heatmaps show it.

`kvscope kv-accuracy --task passkey` saves its run to the user's data folder; the path and
the format are ipc/saved_results.py's, which reads the file strictly. This module keeps the
view of it the heatmaps draw (one SettingGrid a setting, the grid's lengths and depths). A file
that is not a passkey run is refused with a message that says what was wrong; the window then
shows the message instead of a grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvscope.ipc import saved_results


class GridError(ValueError):
    pass


def saved_path() -> Path:
    return saved_results.saved_path("passkey")


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


def parse(data: bytes | str) -> SavedGrid:
    """A SavedGrid from a saved file's bytes, or GridError naming what is wrong."""
    try:
        run = saved_results.decode(data)
    except saved_results.SavedResultsError as exc:
        raise GridError(str(exc)) from None
    if run.task != "passkey":
        raise GridError(f"task is {run.task!r}, not 'passkey'")
    grids = [SettingGrid(name=name, kv_dtype=s.kv_dtype, kv_rotation=s.kv_rotation,
                         kv_anchor_tokens=s.kv_anchor_tokens,
                         # decode refused a passkey cell without a depth: `or 0.0` is for
                         # the type only
                         cells=[Cell(length=c.length, depth=c.depth or 0.0, right=c.right,
                                     same=c.same_as_float32, kl=c.kl, rank=c.rank)
                                for c in s.cells])
             for name, s in run.settings.items()]
    return SavedGrid(model=run.model, date=run.date, seconds=run.seconds,
                     lengths=sorted({c.length for g in grids for c in g.cells}),
                     depths=sorted({c.depth for g in grids for c in g.cells}),
                     settings=grids, partial=run.partial)


def load(path: Path | None = None) -> tuple[SavedGrid | None, str]:
    """(grid, "") or (None, why there is none): never raises for a missing or bad file."""
    path = path or saved_path()
    if not path.exists():
        return None, ("no long-context grid measured yet: press Measure, or run "
                      "`kvscope kv-accuracy --task passkey`")
    try:
        return parse(path.read_bytes()), ""
    except (OSError, GridError) as exc:
        return None, f"ignored the saved grid {path}: {exc}"
