"""The kv-accuracy saved-results format: one long-context run, written by the engine's
measurement and read by the window's KV grid.

`kvscope kv-accuracy --task passkey|document` (or `--trace`/`--prompts`) saves its last run as
JSON under the user's data folder, `saved_path(task)`: $XDG_DATA_HOME/kvscope/kv-accuracy/
last-<task>.json, else ~/.local/share/kvscope/kv-accuracy/... The window reads the passkey
one (app/kv_grid/). Both sides use this module, so the path and the fields are stated once.

A saved file is untrusted input (anything may have written it): it is decoded strictly by
msgspec into these Structs, never evaluated, and a bad file is a SavedResultsError naming the
field that is wrong (as `$.settings.int8.cells[3].kl`). The writer validates the same way
before it writes, so a run the window would refuse is never saved.

Imports neither torch nor Qt: the engine and the app both use this module.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

TASKS = ("passkey", "document", "prompts")
Task = Literal["passkey", "document", "prompts"]
# A share of probes or positions: a mean of 0/1 outcomes.
Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class SavedResultsError(ValueError):
    """A saved run that does not validate; the message names the field and the reason."""


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class SavedAnswer(_Strict, frozen=True):
    """One probe's answer in a cell: the text, and for a passkey the key and whether the text
    holds it."""
    answer: str
    key: int | None = None
    right: bool | None = None


class SavedCell(_Strict, frozen=True):
    """One grid cell (a context length, and for a passkey the key's depth): its probes'
    outcomes against float32 KV, averaged (rank: the median)."""
    length: Count
    tokens: Count  # mean prompt tokens of the cell's probes
    samples: Count
    same_as_float32: Share  # answered token for token as float32 KV did
    agreement: Share  # share of the answer before its first difference from float32's
    top1_agreement: Share  # positions whose most likely token is float32's
    kl: Annotated[float, msgspec.Meta(ge=0.0)]  # mean KL from float32 along the answer
    rank: Annotated[float, msgspec.Meta(ge=0.0)]  # of the right (or float32's) first token
    depth: Share | None = None  # passkey: where the key sits in the context, 0 to 1
    right: Share | None = None  # passkey: share of the cell's keys found
    answers: list[SavedAnswer] = []


class SavedSetting(_Strict, frozen=True):
    """One KV setting of the run, as the engine resolved it, and its cells."""
    kv_dtype: str
    kv_rotation: str
    kv_anchor_tokens: Count
    kv_bytes_per_token: Count
    cells: list[SavedCell]


class SavedRun(_Strict, frozen=True):
    """A whole run: what was measured, where and when, and every setting's cells (float32, the
    reference, first). `partial`: the run was cut short and holds the settings it finished."""
    task: Task
    model: str
    date: str  # ISO 8601, UTC
    seconds: Annotated[float, msgspec.Meta(ge=0.0)]
    machine: str
    probes: Count
    settings: dict[str, SavedSetting]
    partial: bool = False
    # What describes the probes, by task: passkey lengths, depths and seeds; the document's
    # name and cut lengths; the trace or prompts file they came from.
    lengths: list[Count] | None = None
    depths: list[Share] | None = None
    seeds: Count | None = None
    document: str | None = None
    trace: str | None = None
    prompts: str | None = None


def saved_path(task: str) -> Path:
    """Where `kv-accuracy` keeps its last run of `task`, and where the window looks."""
    if task not in TASKS:
        raise ValueError(f"no saved results for task {task!r}: one of {', '.join(TASKS)}")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvscope" / "kv-accuracy" / f"last-{task}.json"


def _check(run: SavedRun) -> SavedRun:
    """What the types cannot say: a run has settings, a setting has cells, a passkey cell has
    a depth."""
    if not run.settings:
        raise SavedResultsError("no settings: `$.settings` is empty")
    for name, setting in run.settings.items():
        if not setting.cells:
            raise SavedResultsError(f"setting {name} has no cells: `$.settings.{name}.cells`")
        if run.task == "passkey":
            for i, cell in enumerate(setting.cells):
                if cell.depth is None:
                    raise SavedResultsError(f"a passkey cell without a depth: "
                                            f"`$.settings.{name}.cells[{i}].depth`")
    return run


_decoder = msgspec.json.Decoder(SavedRun)
_encoder = msgspec.json.Encoder()


def decode(data: bytes | str) -> SavedRun:
    """A SavedRun from a file's bytes, or SavedResultsError saying what is wrong where."""
    try:
        return _check(_decoder.decode(data))
    except msgspec.ValidationError as exc:
        raw = msgspec.json.decode(data)  # valid JSON of the wrong shape: read to name the key
        raise SavedResultsError(f"malformed saved run: {_located(exc, raw)}") from None
    except msgspec.DecodeError as exc:
        raise SavedResultsError(f"not JSON: {exc}") from None


def from_result(result: object) -> SavedRun:
    """A SavedRun from the measurement's result (a dict of built-ins), checked as a read is."""
    try:
        return _check(msgspec.convert(result, SavedRun))
    except msgspec.ValidationError as exc:
        raise SavedResultsError(f"malformed saved run: {_located(exc, result)}") from None


def _located(exc: msgspec.ValidationError, raw: object) -> str:
    """msgspec's message with the setting's name where it wrote `$.settings[...]` (it does
    not name a dict's keys): the first setting that does not validate alone."""
    message = str(exc)
    settings = raw.get("settings") if isinstance(raw, dict) else None
    if "$.settings[...]" not in message or not isinstance(settings, dict):
        return message
    for name, setting in settings.items():
        try:
            msgspec.convert(setting, SavedSetting)
        except msgspec.ValidationError:
            return message.replace("$.settings[...]", f"$.settings.{name}")
    return message


def encode(run: SavedRun) -> bytes:
    return _encoder.encode(run)


def to_builtins(run: SavedRun) -> dict[str, Any]:
    """The run as the file holds it, in dicts and lists (what `--json` prints)."""
    data: dict[str, Any] = msgspec.to_builtins(run)
    return data


def read(path: Path) -> SavedRun:
    """The run saved at `path`; OSError when it cannot be read, SavedResultsError when it is
    not a saved run."""
    return decode(path.read_bytes())


def save(run: SavedRun, path: Path) -> Path:
    """Write atomically (a temporary file renamed over the old one): a window reading the
    file while a run ends sees the old run or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode(run))
    os.replace(tmp, path)
    return path
