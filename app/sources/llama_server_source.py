"""llama.cpp's `llama-server` as a source: a worker thread polls /health, /props, /slots and
/metrics (each call with a timeout and a size cap) and posts what it learned into the mailbox.

Known: per-slot context fill and task (/slots), context size per slot and slot count (/props),
prompt/generation throughput and requests processing/deferred (/metrics, with --metrics; the
generation rate from the slots' n_decoded while /slots is on, since llama-server adds to its
token counters only when a request finishes).
Not known: a block table, KV bytes or KV usage (removed from /metrics in llama.cpp PR #13660),
per-request latency percentiles and device memory.
"""
from __future__ import annotations

import threading
import time

from kvscope.app.sources import http_get
from kvscope.app.sources.llama_server_payloads import (
    METRICS_HELP,
    LlamaSample,
    Props,
    metrics_sample,
    parse_props,
    parse_slots,
    slots_disabled,
)
from kvscope.app.sources.source import (
    CHAT,
    QUEUES,
    SETTINGS,
    SLOTS,
    THROUGHPUT,
    ChatError,
    PolledSource,
    SlotsFrame,
)
from kvscope.app.vllm import prometheus_text
from kvscope.app.vllm.openai_chat import OpenAIChat, OpenAIError
from kvscope.app.vllm.plot_feed import Pct, StatsFrame, StepFrame, StepRecord

POLL_INTERVAL_S = 1.0
PROPS_EVERY_S = 10.0  # the settings change only when the server restarts
KNOWN = ("Known from llama-server: each slot's context fill and task (/slots), the context "
         "size per slot (/props), prompt and generation throughput and requests processing "
         "and deferred (/metrics). Not reported by llama-server: a block table (its KV is one "
         "buffer per slot, or one unified buffer), KV bytes and KV usage (removed from "
         "/metrics in llama.cpp PR #13660), TTFT/ITL percentiles, preemptions and device "
         "memory.")
UNIFIED_UNKNOWN = ("not reported by llama-server (its /props has no kv_unified; the server's "
                   "start-up log says kv_unified = 'true' or 'false')")
RESTART = "llama-server sets this when it starts ({flag}); restart it to change it"
SETTINGS_SHOWN = (  # (key, title, flag)
    ("model", "model", "-m/--model"),
    ("total_slots", "slots", "-np/--parallel"),
    ("n_ctx", "context per slot (tokens)", "-c/--ctx-size, --kv-unified-per-slot"),
    ("kv_unified", "unified KV cache", "-kvu/--kv-unified"),
    ("endpoints", "monitoring endpoints", "--slots/--no-slots, --metrics"),
    ("build", "build", "the binary"),
)


class LlamaServerSource(PolledSource):
    kind = "llama-server"
    capabilities = frozenset({SLOTS, QUEUES, THROUGHPUT, CHAT, SETTINGS})

    def __init__(self, base_url: str, poll_interval_s: float = POLL_INTERVAL_S,
                 timeout_s: float = http_get.TIMEOUT_S) -> None:
        super().__init__(base_url.rstrip("/"))
        self.poll_interval_s, self.timeout_s = poll_interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-llama-server",
                                        daemon=True)
        self.chat = OpenAIChat(self.url)
        self._model: str | None = None
        self.step = 0  # worker thread only
        self.props: Props | None = None  # worker thread only
        self._notice: str | None = None  # worker thread only
        self._decoded: tuple[float, dict] | None = None  # worker thread only
        self.slot_rate: float | None = None  # worker thread only

    def known(self) -> str:
        return KNOWN

    def settings_rows(self) -> list[tuple[str, str, str]]:
        return [(key, title, RESTART.format(flag=flag)) for key, title, flag in SETTINGS_SHOWN]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * self.timeout_s + 2)

    def stream_chat(self, messages: list[dict], sampling: dict):
        try:
            if self._model is None:
                models = self.chat.models()
                self._model = models[0] if models else "default"
            yield from self.chat.stream_chat(
                messages, self._model, max_tokens=int(sampling.get("max_tokens", 256)),
                temperature=float(sampling.get("temperature", 0.7)))
        except OpenAIError as exc:
            raise ChatError(str(exc)) from None

    # -- worker thread -----------------------------------------------------------------------
    def _get(self, path: str) -> http_get.Reply:
        return http_get.get(self.url + path, timeout=self.timeout_s)

    def _run(self) -> None:
        previous: tuple[prometheus_text.Samples, float] | None = None
        next_props = 0.0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                health = self._get("/health")
                if health.status == 503:  # loading the model: there, not ready
                    self.mailbox.post(error=None, scraped_ok=True,
                                      facts="loading the model (/health: 503)")
                else:
                    if self.props is None or started >= next_props:
                        self._poll_props()
                        next_props = started + PROPS_EVERY_S
                    self._poll_slots()
                    previous = self._poll_metrics(previous)
                    self.mailbox.post(error=None, scraped_ok=True, facts=self._facts())
            except http_get.Unreachable as exc:
                self.props, previous = None, None  # a restarted server may differ
                self.mailbox.post(error=str(exc))
            self._stop.wait(max(0.05, self.poll_interval_s - (time.monotonic() - started)))

    def _bad(self, what: str, exc: Exception) -> None:
        self.mailbox.count_bad(f"{what}: {exc}")

    def _poll_props(self) -> None:
        reply = self._get("/props")
        try:
            if reply.status != 200:
                raise http_get.BadPayload(f"HTTP {reply.status}")
            self.props = parse_props(reply.json("/props"))
        except http_get.BadPayload as exc:
            return self._bad("/props", exc)
        self.mailbox.post(settings=self._settings(self.props))

    def _poll_slots(self) -> None:
        reply = self._get("/slots")
        disabled = slots_disabled(reply.status, reply.body)
        if disabled is not None:
            self.mailbox.post(slots=SlotsFrame(time.time(), (), disabled))
            return
        try:
            frame = parse_slots(reply.json("/slots"))
        except http_get.BadPayload as exc:
            return self._bad("/slots", exc)
        self.slot_rate = self._slot_rate(frame)
        self.mailbox.post(slots=frame)

    def _slot_rate(self, frame: SlotsFrame) -> float | None:
        """Generated tokens a second, from the slots' n_decoded between two polls: live,
        where llama-server adds to its /metrics counters only when a request finishes."""
        now = {(s.id, s.task): s.n_decoded for s in frame.slots
               if s.task is not None and s.n_decoded is not None}
        before, self._decoded = self._decoded, (frame.time, now)
        if before is None or frame.time <= before[0]:
            return None
        gained = sum(max(0, n - before[1].get(key, 0)) for key, n in now.items())
        return gained / (frame.time - before[0])

    def _poll_metrics(self, previous):
        reply = self._get("/metrics")
        if reply.status == 501:
            self._set_notice(METRICS_HELP)
            return None
        try:
            if reply.status != 200:
                raise http_get.BadPayload(f"HTTP {reply.status}")
            samples = prometheus_text.parse(reply.body.decode("utf-8", errors="replace"))
            now = time.time()
            if previous is not None:
                self._post_sample(metrics_sample(previous[0], samples, previous[1], now))
            elif not any(k.startswith("llamacpp:") for k in samples):
                raise http_get.BadPayload("no llamacpp: metrics")
        except (prometheus_text.MetricsError, http_get.BadPayload) as exc:
            self._bad("/metrics", exc)
            return previous
        self._set_notice("")
        return samples, now

    def _set_notice(self, text: str) -> None:
        if text != self._notice:
            self._notice = text
            self.mailbox.post(notice=text)

    def _post_sample(self, s: LlamaSample) -> None:
        self.step += 1
        rec = StepRecord(self.step, s.time, s.prompt_tokens_per_decode,
                         s.generation_tokens_per_decode, s.processing, s.deferred)
        gen = self.slot_rate if self.slot_rate is not None else s.generation_tokens_per_s
        stats = StatsFrame(s.time, s.prompt_tokens_per_s or 0.0, gen or 0.0,
                           Pct(None, None), Pct(None, None), None)
        self.mailbox.post(steps=[StepFrame(s.time, [rec], None)], stats=[stats], samples=[s])

    def _facts(self) -> str:
        p = self.props
        if p is None:
            return "no /props"
        return (f"{p.model or '?'} · {p.total_slots or '?'} slots × {p.n_ctx or '?'} tokens"
                + (" · sleeping" if p.sleeping else ""))

    @staticmethod
    def _settings(p: Props) -> dict[str, str]:
        ends = [name for name, on in (("/slots", p.endpoint_slots),
                                      ("/metrics", p.endpoint_metrics)) if on]
        return {"model": p.model or "not reported by llama-server",
                "total_slots": "—" if p.total_slots is None else str(p.total_slots),
                "n_ctx": "—" if p.n_ctx is None else str(p.n_ctx),
                "kv_unified": UNIFIED_UNKNOWN if p.kv_unified is None
                else ("yes" if p.kv_unified else "no"),
                "endpoints": ", ".join(ends) or "none reported",
                "build": p.build or "—"}
