"""Bounded HTTP GETs for the polled sources: every call has a timeout and a size cap, so a slow
or hostile server costs a worker thread a few seconds at most and never the window."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

TIMEOUT_S = 2.0
MAX_BYTES = 16 << 20


class Unreachable(Exception):
    """Nothing answered (refused, timed out, reset): the server is gone or stalled."""


class BadPayload(ValueError):
    """The server answered, but not with what it should have."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes

    def json(self, what: str):
        try:
            return json.loads(self.body)
        except ValueError:
            raise BadPayload(f"{what} is not JSON: {self.body[:80]!r}") from None


def get(url: str, timeout: float = TIMEOUT_S, max_bytes: int = MAX_BYTES,
        api_key: str | None = None) -> Reply:
    """The reply, whatever its HTTP status (errors carry a body worth reading)."""
    headers = {"Accept": "application/json, text/plain"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return Reply(reply.status, _read(reply, max_bytes, url))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read(min(max_bytes, 64 << 10)))
    except (TimeoutError, urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"{url}: {reason or type(exc).__name__}") from None


def _read(reply, max_bytes: int, url: str) -> bytes:
    body = reply.read(max_bytes + 1)
    if len(body) > max_bytes:
        raise BadPayload(f"{url}: reply is over {max_bytes >> 20} MiB")
    return body
