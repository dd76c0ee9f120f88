"""The OpenAI wire side of a replay against an external server: the request body built from a
replay item, and what each streamed chunk says (text, finish reason, usage, an error).

Chunks are decoded by msgspec into loose Structs (unknown fields ignored: every server adds
its own); anything else is a ChunkError naming what was wrong. Nothing is evaluated.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvscope.engine.traces.workload import WorkItem

API_PATHS = {"completions": "/completions", "chat": "/chat/completions"}


class ChunkError(ValueError):
    """A streamed chunk that is not an OpenAI completion chunk."""


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None
    object: str | None = None
    message: str | None = None  # vLLM's older {"object": "error", "message": ...}


_decoder = msgspec.json.Decoder(_Chunk)


class ChunkInfo(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


def read_chunk(data: str) -> ChunkInfo:
    """One event's data (not "[DONE]") as what it says; ChunkError if it is not a chunk."""
    try:
        chunk = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ChunkError(f"a streamed chunk that is not an OpenAI chunk: {exc}: "
                         f"{data[:120]!r}") from None
    info = ChunkInfo()
    if chunk.error is not None or chunk.object == "error":
        info.error = error_message(chunk.error if chunk.error is not None else chunk.message)
    for choice in chunk.choices or []:
        info.text += choice.text or (choice.delta.content if choice.delta else None) or ""
        info.finish_reason = choice.finish_reason or info.finish_reason
    if chunk.usage is not None:
        info.prompt_tokens = chunk.usage.prompt_tokens
        info.completion_tokens = chunk.usage.completion_tokens
    return info


def error_message(error: object) -> str:
    """An OpenAI error object ({"message": ...}), or whatever a server put there, as text."""
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str):
            return message[:500]
    return str(error)[:500]


def error_of_body(body: bytes) -> str:
    """The message of an error reply's body: OpenAI's {"error": {...}}, else its text."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:300].decode(errors="replace").strip() or "(empty body)"
    if isinstance(obj, dict):
        if "error" in obj:
            return error_message(obj["error"])
        if isinstance(obj.get("message"), str):
            return str(obj["message"])[:500]
        if isinstance(obj.get("detail"), str):
            return str(obj["detail"])[:500]
    return str(obj)[:300]


# -- request bodies --------------------------------------------------------------------------
def expected_tokens(item: WorkItem) -> int:
    """The output length the replay asks for: the recorded one where the trace has it."""
    if item.recorded_output:
        return len(item.recorded_output)
    return item.max_tokens


def sampling_fields(item: WorkItem, ignore_eos: bool) -> dict[str, Any]:
    """The recorded sampling as OpenAI (and vLLM-extra) fields; extras only where set, so
    servers that refuse unknown values see nothing they would refuse."""
    s = item.sampling
    out: dict[str, Any] = {"max_tokens": item.max_tokens,
                           "temperature": float(s.get("temperature", 0.0) or 0.0)}
    if s.get("top_p") not in (None, 1, 1.0):
        out["top_p"] = s["top_p"]
    if isinstance(s.get("top_k"), int) and s["top_k"] > 0:
        out["top_k"] = s["top_k"]
    if s.get("seed") is not None:
        out["seed"] = s["seed"]
    for key in ("stop", "stop_token_ids"):
        if s.get(key):
            out[key] = s[key]
    if s.get("ignore_eos"):
        out["ignore_eos"] = True
    if item.priority not in (0, None):
        out["priority"] = item.priority
    if ignore_eos:  # the recorded length, exactly
        out["max_tokens"], out["ignore_eos"] = expected_tokens(item), True
    return out


def request_body(item: WorkItem, model: str, api: str, ignore_eos: bool,
                 prompt_text: str | None = None) -> dict[str, Any]:
    """A streaming request with usage asked for. completions: the prompt as token ids;
    chat: prompt_text as one user message."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True},
                            **sampling_fields(item, ignore_eos)}
    if api == "chat":
        if prompt_text is None:
            raise ValueError("--chat sends prompts as text: give --tokenizer to decode them")
        body["messages"] = [{"role": "user", "content": prompt_text}]
    else:
        body["prompt"] = item.prompt
    return body
