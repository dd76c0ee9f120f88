"""What the window remembers per model (QSettings): the recently opened models, and the
engine settings applied in the window for each model, so a later start on that model (or a
switch back to it) comes back as the user left it.

Saved values are untrusted input: the settings are msgspec JSON decoded into EngineSettings
(a wrong type is dropped, never guessed at), paths are only ever shown and passed to the
engine child as its --model.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
from PySide6.QtCore import QSettings

from kvscope.ipc.messages import EngineSettings

RECENT_KEY = "models/recent"
RECENT_MAX = 8
DEFAULT_MODEL = "default"  # the embedded SmolLM2, the engine's --model default


def model_key(model: str | None) -> str:
    """One name per model: "default", or the absolute path of a folder or file."""
    if not model or model == DEFAULT_MODEL:
        return DEFAULT_MODEL
    return str(Path(model).expanduser().resolve())


def recent_models(s: QSettings) -> list[str]:
    value = s.value(RECENT_KEY)
    if isinstance(value, str):
        value = [value]  # QSettings gives a one-item list back as a string
    return [str(v) for v in (value or []) if isinstance(v, str) and v][:RECENT_MAX]


def remember_model(s: QSettings, model: str) -> list[str]:
    """Put the model first in the recent list (no duplicates, at most RECENT_MAX)."""
    key = model_key(model)
    if key == DEFAULT_MODEL:
        return recent_models(s)
    recent = [key, *(m for m in recent_models(s) if m != key)][:RECENT_MAX]
    s.setValue(RECENT_KEY, recent)
    s.sync()
    return recent


def _applied_key(model: str | None) -> str:
    digest = hashlib.sha256(model_key(model).encode()).hexdigest()[:20]
    return f"models/applied/{digest}"


def save_applied(s: QSettings, model: str | None, config: EngineSettings) -> None:
    """The settings applied in the window while `model` ran (a later start restores them)."""
    s.setValue(_applied_key(model), msgspec.json.encode(config).decode())
    s.sync()


def applied_for(s: QSettings, model: str | None) -> EngineSettings | None:
    """The settings last applied to `model` in the window; None if none (or unreadable)."""
    value = s.value(_applied_key(model))
    if not isinstance(value, str):
        return None
    try:
        return msgspec.json.decode(value, type=EngineSettings)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def forget_applied(s: QSettings, model: str | None) -> None:
    s.remove(_applied_key(model))
    s.sync()


def model_of(engine_args: list[str]) -> str:
    """The --model in a local engine's options (the last one wins), else "default"."""
    model = DEFAULT_MODEL
    for i, arg in enumerate(engine_args[:-1]):
        if arg == "--model":
            model = engine_args[i + 1]
    return model


def without_options(engine_args: list[str], options: dict[str, bool]) -> list[str]:
    """engine_args less each option in `options` (name -> whether it takes a value)."""
    out, i = [], 0
    while i < len(engine_args):
        arg = engine_args[i]
        if arg in options:
            i += 2 if options[arg] else 1
            continue
        out.append(arg)
        i += 1
    return out
