"""llama.cpp's `llama-server` replies -> what the window draws. Pure functions, no I/O.

Shapes as tools/server/server-context.cpp writes them (llama.cpp of llama-cpp-python 0.3.36;
a captured sample is in tests/fixtures/llama_server_*):
* GET /slots: [{"id", "n_ctx", "speculative", "is_processing", "id_task",
  "n_prompt_tokens" (tokens in the slot's KV: prompt + generated), "n_prompt_tokens_processed",
  "n_prompt_tokens_cache", "params", "next_token": [{"has_next_token", "n_remain",
  "n_decoded"}], "prompt", "generated"}, ...]; a slot never used has only the first four.
  Started with --no-slots: HTTP 501 {"error": {"message": "... Start it with `--slots`"}}.
* GET /props: {"default_generation_settings": {"n_ctx", "params"}, "total_slots",
  "model_alias", "model_path", "build_info", "endpoint_slots", "endpoint_metrics", ...}.
* GET /metrics (only with --metrics): llamacpp:prompt_tokens_total, prompt_seconds_total,
  tokens_predicted_total, tokens_predicted_seconds_total, n_decode_total, n_tokens_max,
  requests_processing, requests_deferred, prompt_tokens_seconds, predicted_tokens_seconds,
  n_busy_slots_per_decode. Since PR #13660 no KV usage and no KV token count.
Untrusted input: anything of the wrong shape is a BadPayload naming the field.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvscope.app.sources.http_get import BadPayload
from kvscope.app.sources.source import SlotsFrame, SlotState
from kvscope.app.vllm.prometheus_text import Samples, total

SLOTS_HELP = ("llama-server's /slots is off: start it without --no-slots (or with --slots; "
              "LLAMA_ARG_ENDPOINT_SLOTS=1) to see each slot's context fill")
METRICS_HELP = ("llama-server's /metrics is off: start it with --metrics "
                "(LLAMA_ARG_ENDPOINT_METRICS=1) for throughput and queues")
MAX_SLOTS = 4096


def _int(value, what: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadPayload(f"{what} is {value!r}, not an integer")
    return value


def parse_slots(body, now: float | None = None) -> SlotsFrame:
    """/slots' JSON list -> SlotsFrame (BadPayload when it is not a list of slot objects)."""
    if not isinstance(body, list) or len(body) > MAX_SLOTS:
        raise BadPayload(f"/slots is {type(body).__name__}, not a list of slots")
    slots = []
    for i, s in enumerate(body):
        if not isinstance(s, dict):
            raise BadPayload(f"/slots[{i}] is {type(s).__name__}, not an object")
        task = _int(s.get("id_task"), f"/slots[{i}].id_task", allow_none=True)
        nxt = s.get("next_token")
        nxt = nxt[0] if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict) else {}
        slots.append(SlotState(
            id=_int(s.get("id"), f"/slots[{i}].id"),
            n_ctx=max(0, _int(s.get("n_ctx"), f"/slots[{i}].n_ctx")),
            n_used=_used(s, i, task),
            task=None if task is None or task < 0 else task,
            processing=bool(s.get("is_processing", False)),
            n_decoded=_int(nxt.get("n_decoded"), f"/slots[{i}].n_decoded", True),
            n_remain=_int(nxt.get("n_remain"), f"/slots[{i}].n_remain", True)))
    return SlotsFrame(time.time() if now is None else now, tuple(slots))


def _used(s: dict, i: int, task: int | None) -> int | None:
    """Tokens in the slot's KV. A slot that never had a task has none; a server too old to
    send n_prompt_tokens leaves the fill unknown (None, never drawn as 0)."""
    used = _int(s.get("n_prompt_tokens"), f"/slots[{i}].n_prompt_tokens", True)
    if used is None and task is None and "params" not in s:
        return 0
    return used


def slots_disabled(status: int, body: bytes) -> str | None:
    """The reason /slots gave nothing (with how to enable it), or None if it answered."""
    if status == 200:
        return None
    text = body[:300].decode("utf-8", errors="replace")
    if status == 501 or "slots endpoint" in text:
        return SLOTS_HELP
    return f"/slots answered HTTP {status}: {text}"


@dataclass(frozen=True)
class Props:
    total_slots: int | None
    n_ctx: int | None  # per slot
    model: str | None
    build: str | None
    kv_unified: bool | None  # None: not reported (this server's /props has no such field)
    endpoint_slots: bool | None
    endpoint_metrics: bool | None
    sleeping: bool


def parse_props(body) -> Props:
    if not isinstance(body, dict):
        raise BadPayload(f"/props is {type(body).__name__}, not an object")
    gen = body.get("default_generation_settings")
    gen = gen if isinstance(gen, dict) else {}
    model = body.get("model_alias") or body.get("model_path")
    unified = body.get("kv_unified")
    return Props(
        total_slots=_int(body.get("total_slots"), "/props.total_slots", True),
        n_ctx=_int(gen.get("n_ctx"), "/props.default_generation_settings.n_ctx", True),
        model=str(model).replace("\\", "/").rsplit("/", 1)[-1] if model else None,
        build=str(body["build_info"]) if body.get("build_info") else None,
        kv_unified=unified if isinstance(unified, bool) else None,
        endpoint_slots=body.get("endpoint_slots") if isinstance(
            body.get("endpoint_slots"), bool) else None,
        endpoint_metrics=body.get("endpoint_metrics") if isinstance(
            body.get("endpoint_metrics"), bool) else None,
        sleeping=bool(body.get("is_sleeping", False)))


@dataclass(frozen=True)
class LlamaSample:
    """Two /metrics scrapes apart: rates from the counters, queues from the gauges."""
    time: float
    interval_s: float
    processing: float | None  # requests in a slot now
    deferred: float | None  # requests waiting for a slot
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    decodes: float | None  # llama_decode() calls in the interval
    prompt_tokens_per_decode: float | None
    generation_tokens_per_decode: float | None
    busy_slots_per_decode: float | None  # since the server started
    n_tokens_max: float | None


P = "llamacpp:"


def metrics_sample(old: Samples, new: Samples, old_t: float, new_t: float) -> LlamaSample:
    if not any(name.startswith(P) for name in new):
        raise BadPayload("/metrics has no llamacpp: metrics")
    dt = max(1e-9, new_t - old_t)

    def gain(name: str) -> float | None:
        a, b = total(old, P + name), total(new, P + name)
        return None if a is None or b is None else max(0.0, b - a)

    prompt, gen, decodes = gain("prompt_tokens_total"), gain("tokens_predicted_total"), \
        gain("n_decode_total")

    def per_decode(g: float | None) -> float | None:
        return None if g is None or not decodes else g / decodes

    return LlamaSample(
        time=new_t, interval_s=dt,
        processing=total(new, P + "requests_processing"),
        deferred=total(new, P + "requests_deferred"),
        prompt_tokens_per_s=None if prompt is None else prompt / dt,
        generation_tokens_per_s=None if gen is None else gen / dt,
        decodes=decodes, prompt_tokens_per_decode=per_decode(prompt),
        generation_tokens_per_decode=per_decode(gen),
        busy_slots_per_decode=total(new, P + "n_busy_slots_per_decode"),
        n_tokens_max=total(new, P + "n_tokens_max"))
