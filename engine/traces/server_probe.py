"""What an OpenAI-compatible server says about itself before a replay: its /v1/models answer
(the model to ask for when none is given) and /version where it has one (vLLM, kvscope).

The URL a user gives is the API base (`http://host:8000/v1`) or the server root
(`http://host:8000`, then /v1 is appended)."""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from kvscope.engine.traces.openai_stream import error_of_body

MAX_INFO_BYTES = 256 * 1024


def api_base(url: str) -> str:
    """The API base URL (ending in /v1 or another /vN). ValueError for a URL that is not
    http(s)://host[:port][/path]."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r} must be an http:// or https:// URL, "
                         f"e.g. http://127.0.0.1:8000/v1")
    if parts.query or parts.fragment:
        raise ValueError(f"--url {url!r}: no query or fragment, just the API's base")
    base = url.strip().rstrip("/")
    return base if re.search(r"/v\d+$", parts.path.rstrip("/")) else base + "/v1"


def server_root(base: str) -> str:
    return re.sub(r"/v\d+$", "", base)


class ServerAnswers(msgspec.Struct):
    models: Any = None  # the /v1/models JSON, None if it did not answer with JSON
    models_error: str | None = None
    version: Any = None
    model_ids: list[str] = msgspec.field(default_factory=list)


async def _get_json(client: httpx.AsyncClient, url: str) -> tuple[Any, str | None]:
    try:
        resp = await client.get(url)
    except httpx.HTTPError as exc:
        return None, f"GET {url}: {type(exc).__name__}: {exc}"
    body = resp.content[:MAX_INFO_BYTES]
    if resp.status_code != 200:
        return None, f"GET {url} answered HTTP {resp.status_code}: {error_of_body(body)}"
    try:
        return msgspec.json.decode(body), None
    except msgspec.DecodeError:
        return None, f"GET {url} did not answer JSON: {body[:120]!r}"


async def probe(client: httpx.AsyncClient, base: str) -> ServerAnswers:
    models, error = await _get_json(client, base + "/models")
    version, _ = await _get_json(client, server_root(base) + "/version")
    ids: list[str] = []
    data = models.get("data") if isinstance(models, dict) else None
    for entry in data if isinstance(data, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            ids.append(entry["id"])
    return ServerAnswers(models=models, models_error=error, version=version, model_ids=ids)


def choose_model(answers: ServerAnswers, asked: str | None) -> str:
    """--model, else the only (or first) model the server lists; ValueError if it lists none."""
    if asked:
        return asked
    if answers.model_ids:
        return answers.model_ids[0]
    why = answers.models_error or "it lists no models"
    raise ValueError(f"which model to ask for? {why}; give --model (or the right --api-key)")
