"""A small client of the OpenAI chat API (`/v1/models`, streaming `/v1/chat/completions`) that
works against any OpenAI-compatible server: vLLM, kvscope's own, others.

Blocking calls, for a worker thread. Replies are untrusted: JSON only, lines and bodies
bounded, and every failure is an OpenAIError that says what went wrong.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

MAX_LINE = 1 << 20
MAX_BODY = 4 << 20


class OpenAIError(Exception):
    pass


class OpenAIChat:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        base = base_url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.api_key, self.timeout = api_key, timeout

    def models(self) -> list[str]:
        body = self._json(self._open("GET", "/models").read(MAX_BODY + 1))
        try:
            return [str(m["id"]) for m in body["data"]]
        except (KeyError, TypeError) as exc:
            raise OpenAIError(f"{self.base}/models: unexpected reply ({exc!r} missing)") from None

    def stream_chat(self, messages: list[dict], model: str, *, max_tokens: int = 256,
                    temperature: float = 0.7) -> Iterator[str]:
        """The reply's text pieces as they arrive."""
        payload = {"model": model, "messages": messages, "max_tokens": max_tokens,
                   "temperature": temperature, "stream": True}
        with self._open("POST", "/chat/completions", payload) as reply:
            for raw in iter(lambda: reply.readline(MAX_LINE + 1), b""):
                if len(raw) > MAX_LINE:
                    raise OpenAIError("a streamed line is over 1 MiB")
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, ": keep-alive" comments, event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = self._json(data)
                if "error" in chunk:
                    raise OpenAIError(f"the server reported: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield str(text)

    def _open(self, method: str, path: str, payload: dict | None = None):
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode(errors="replace")
            raise OpenAIError(f"{method} {self.base}{path}: HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise OpenAIError(f"{method} {self.base}{path}: {exc}") from None

    @staticmethod
    def _json(data: bytes):
        if len(data) > MAX_BODY:
            raise OpenAIError("reply body is over 4 MiB")
        try:
            return json.loads(data)
        except ValueError:
            raise OpenAIError(f"reply is not JSON: {data[:200]!r}") from None
