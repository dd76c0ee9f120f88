"""The progress lines `kvscope trace replay --url --progress` writes to stderr, one JSON object
a line: {"progress": {"done", "total", "errors", "in_flight"}}. Anything else is a log line."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ReplayProgress:
    done: int
    total: int
    errors: int
    in_flight: int


def parse_progress(line: str) -> ReplayProgress | None:
    line = line.strip()
    if not line.startswith('{"progress"'):
        return None
    try:
        p = json.loads(line)["progress"]
        return ReplayProgress(int(p["done"]), int(p["total"]), int(p["errors"]),
                              int(p["in_flight"]))
    except (ValueError, KeyError, TypeError):
        return None


class ProgressReader:
    """Feed it stderr bytes as they come; it returns the newest progress in them."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> ReplayProgress | None:
        *lines, self._buf = (self._buf + data).split(b"\n")
        latest = None
        for raw in lines:
            latest = parse_progress(raw.decode(errors="replace")) or latest
        return latest
