"""The OpenAI API's request and response bodies as msgspec Structs (decoded from untrusted
JSON, never eval'd), and their translation into the engine's own `Submit` command.

Requests keep unknown fields out of the way (clients send many we do not use), but a field
kvscope cannot honour with the value given (`n` > 1, logprobs, tools, penalties) is a clear
400 naming it rather than a silent surprise.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvscope.engine.sampling_params import PRIORITY_MAX, PRIORITY_MIN
from kvscope.ipc import messages as m
from kvscope.ipc.prompts import ChatPrompt, TextPrompt, TokenPrompt


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, the offending param and a code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# -- requests --------------------------------------------------------------------------------
class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class MessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (OpenAI's and vLLM's extra sampling fields)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extras that kvscope's sampler has.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's: lower is served sooner under --scheduling-policy priority (ignored under fcfs).
    # Typed int, so JSON true, 1.5 or "1" fail decoding as `$.priority` like any bad field.
    priority: int | None = None
    repetition_penalty: float | None = None  # vLLM's extra, as Hugging Face's (1 = off)


class ChatRequest(_Common, kw_only=True):
    messages: list[MessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    prompt: Any = None  # /v1/completions' field: refused here, never silently dropped


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a one-element list of either
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    messages: Any = None  # /v1/chat/completions' field: refused here, never silently dropped


def decode_request(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rpartition("at `$.")[2].rstrip("`").split("[")[0].split(".")[0] \
            if "at `$." in text else None
        raise ApiError(400, f"invalid request: {text}", param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def check_unsupported(req: _Common) -> None:
    if req.n not in (None, 1):
        raise _bad("n", f"n={req.n} is not supported: kvscope returns one choice (n=1)")
    if req.frequency_penalty not in (None, 0, 0.0):
        raise _bad("frequency_penalty",
                   "frequency_penalty is not supported by kvscope's sampler (use 0)")
    if isinstance(req, ChatRequest):
        if req.logprobs or req.top_logprobs:
            raise _bad("logprobs", "logprobs are not supported by kvscope")
        if req.tools:
            raise _bad("tools", "tool calls are not supported by kvscope")
    else:
        if req.logprobs:
            raise _bad("logprobs", "logprobs are not supported by kvscope")
        if req.echo:
            raise _bad("echo", "echo is not supported by kvscope")
        if req.best_of not in (None, 1):
            raise _bad("best_of", f"best_of={req.best_of} is not supported (use 1)")
        if req.suffix:
            raise _bad("suffix", "suffix is not supported by kvscope")


def sampling_of(req: _Common, default_max_tokens: int) -> m.Sampling:
    """The engine's sampling fields; the values are checked here so the error names the
    OpenAI parameter (the engine checks them again)."""
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise _bad(param, f"{param} must be at least 1, got {max_tokens}")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise _bad("temperature", f"temperature must be in [0, 2], got {temperature}")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise _bad("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = req.top_k or 0
    if top_k < 0 and top_k != -1:  # vLLM spells "off" as -1
        raise _bad("top_k", f"top_k must be -1, 0 (off) or positive, got {top_k}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if not all(stop):
        raise _bad("stop", "stop strings must not be empty")
    stop_ids = list(req.stop_token_ids or [])
    if any(t < 0 for t in stop_ids):
        raise _bad("stop_token_ids", "stop_token_ids must be token ids (>= 0)")
    priority = 0 if req.priority is None else req.priority
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise _bad("priority", f"priority must be an integer in [{PRIORITY_MIN}, "
                               f"{PRIORITY_MAX}] (lower = sooner), got {priority}")
    presence = req.presence_penalty or 0.0
    if not -2 <= presence <= 2:
        raise _bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {presence}")
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not repetition > 0:
        raise _bad("repetition_penalty",
                   f"repetition_penalty must be > 0 (1 = off), got {repetition}")
    return m.Sampling(max_tokens=max_tokens or default_max_tokens, temperature=temperature,
                      top_p=top_p, top_k=max(top_k, 0), seed=req.seed, stop=stop,
                      stop_token_ids=stop_ids, ignore_eos=req.ignore_eos, priority=priority,
                      presence_penalty=presence, repetition_penalty=repetition)


def chat_prompt(req: ChatRequest) -> ChatPrompt:
    """The request's conversation as the engine's typed prompt (ipc.prompts), checked here so
    a bad one is a 400 before the engine thread sees it."""
    if req.prompt is not None:
        raise _bad("prompt", "give exactly one of prompt or messages: /v1/chat/completions "
                             "takes messages (a raw prompt goes to /v1/completions)")
    try:
        return ChatPrompt(chat_messages(req))
    except ValueError as exc:
        raise _bad("messages", str(exc)) from None


def chat_messages(req: ChatRequest) -> list[m.ChatMessage]:
    """OpenAI messages as the engine's: content parts flattened to their text."""
    if not req.messages:
        raise _bad("messages", "messages is empty")
    out = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p.text or "" for p in content)
        out.append(m.ChatMessage(msg.role, content or ""))
    return out


def completion_prompt(req: CompletionRequest) -> TextPrompt | TokenPrompt:
    """The request's prompt (text or token ids) as the engine's typed prompt (ipc.prompts),
    checked here so a bad one is a 400 before the engine thread sees it."""
    if req.messages is not None:
        raise _bad("messages", "give exactly one of prompt or messages: /v1/completions takes "
                               "prompt (messages go to /v1/chat/completions)")
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    try:
        if isinstance(prompt, str):
            return TextPrompt(prompt)
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return TokenPrompt(prompt)
    except ValueError as exc:  # empty text, a negative token id
        raise _bad("prompt", str(exc)) from None
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("prompt", f"a batch of {len(prompt)} prompts is not supported: send one "
                             f"request per prompt")
    raise _bad("prompt", "prompt must be a non-empty string or a list of token ids")

# -- responses -------------------------------------------------------------------------------
class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"


class Model(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "kvscope"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"
