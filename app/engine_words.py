"""The engine's messages in the window's words: an engine error names its config fields
(`EngineConfig.kv_cache_bytes=...`), the window names its controls ("KV memory budget"). Used
where an engine's refusal or failure is shown (the Engine tab, the status bar, the chat).

A failure message also carries the last lines the engine child printed; a line said twice
there (a log line and the error it ends with) is said once."""
from __future__ import annotations

import re

from kvscope.app.fmt import human_bytes

_POOL_TOO_SMALL = re.compile(
    r"(?:kvscope serve: error: )?EngineConfig\.kv_cache_bytes=(?P<budget>\d+) is invalid: "
    r"one block of (?P<block>\d+) tokens needs (?P<need>\d+) bytes")


def _pool_too_small(m: re.Match) -> str:
    budget, block, need = int(m["budget"]), int(m["block"]), int(m["need"])
    return (f"the KV memory budget ({human_bytes(budget)}) is too small: one block of {block} "
            f"tokens needs {human_bytes(need)}. Raise the KV memory budget (Engine tab, or "
            "--kv-cache-bytes) or lower the block size")


def in_window_words(message: str) -> str:
    """The message with engine field names put as the window's controls say them, each
    line said once."""
    text = _POOL_TOO_SMALL.sub(_pool_too_small, message)
    seen: set[str] = set()
    lines = []
    for line in text.split("\n"):
        key = line.strip()
        if key and any(key in earlier for earlier in seen):  # said already, maybe inside one
            continue
        seen.add(key)
        lines.append(line)
    return "\n".join(lines)
