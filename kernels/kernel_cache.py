"""The on-disk cache of kernel choices: one JSON file per user, `kernel_choices.json` under
`$KVSCOPE_CACHE_DIR`, else `~/.cache/kvscope`.

The file holds the machine key it was measured under (kernels.machine_key) and the choices.
A file that is missing, unreadable or not the expected JSON ("corrupt"), or measured under
another key ("stale-key": another CPU, changed kernel sources, another torch) is ignored: the
choices are measured again and the file rewritten. Every such case is logged on
"kvscope.kernels" with the reason as a record attribute (`record.reason`), so a test or a
log filter can read it without parsing the message. Writes go to a temporary file in the
same folder and are renamed over the old one, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("kvscope.kernels")
ENV = "KVSCOPE_CACHE_DIR"
FILE_NAME = "kernel_choices.json"
VERSION = 1

Choices = dict[str, dict[str, Any]]


def cache_dir() -> Path:
    env = os.environ.get(ENV, "").strip()
    return Path(env) if env else Path.home() / ".cache" / "kvscope"


def cache_path() -> Path:
    return cache_dir() / FILE_NAME


def _ignored(path: Path, reason: str, detail: str, quiet: bool) -> tuple[Choices, str]:
    if quiet:
        return {}, reason
    level = logging.INFO if reason == "missing" else logging.WARNING
    log.log(level, "kernel choice cache %s ignored: reason=%s (%s); measuring again", path,
            reason, detail, extra={"reason": reason, "path": str(path)})
    return {}, reason


def load(path: Path, key: dict[str, str], quiet: bool = False
         ) -> tuple[Choices, str | None]:
    """(choices, None) from a valid file for this key, else ({}, reason) with reason one of
    "missing", "corrupt", "stale-key" (logged unless quiet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return _ignored(path, "missing", "no file yet", quiet)
    except OSError as e:
        return _ignored(path, "corrupt", f"unreadable: {e}", quiet)
    try:
        data = json.loads(text)
    except ValueError as e:
        return _ignored(path, "corrupt", f"not JSON: {e}", quiet)
    if not (isinstance(data, dict) and data.get("version") == VERSION
            and isinstance(data.get("key"), dict) and isinstance(data.get("choices"), dict)
            and all(isinstance(v, dict) and isinstance(v.get("choice"), str)
                    for v in data["choices"].values())):
        return _ignored(path, "corrupt", "not a kernel choice file of this version", quiet)
    if data["key"] != key:
        changed = sorted(k for k in {*key, *data["key"]} if key.get(k) != data["key"].get(k))
        return _ignored(path, "stale-key", f"changed: {', '.join(changed)}", quiet)
    return data["choices"], None


def save(path: Path, key: dict[str, str], choices: Choices) -> bool:
    """Write the file atomically; False (logged, not raised) where the folder is not
    writable: the choices then last for this process only."""
    body = json.dumps({"version": VERSION, "key": key, "choices": choices}, indent=1,
                      sort_keys=True)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kernel_choices-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        log.warning("kernel choice cache %s not written: %s", path, e,
                    extra={"reason": "unwritable", "path": str(path)})
        return False
    return True
