"""The load generator pointed at any OpenAI-compatible URL (kvscope's own API, vLLM,
llama.cpp, ...): gamma arrivals at a rate with a burstiness, at most N streams in flight,
seeded random prompts, streaming `/completions`; reports TTFT, inter-token latency and output
throughput as `vllm bench serve` does. Qt's own network stack, so no thread and no blocking."""
from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, QUrl, Signal
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkReply, QNetworkRequest
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
)

from kvscope.app.controls.load_stats import LoadStats, gamma_gap

WORDS = ["the", "cache", "keeps", "every", "layer", "key", "and", "value", "so", "each",
         "decode", "step", "only", "computes", "one", "new", "token", "while", "blocks", "of",
         "memory", "are", "handed", "out", "on", "demand"]
MAX_BACKLOG = 256


@dataclass
class _Live:
    sent: float
    buf: bytes = b""
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None


class OpenAILoad(QObject):
    changed = Signal()

    def __init__(self, parent: QObject | None = None, clock=time.monotonic) -> None:
        super().__init__(parent)
        self.url, self.model, self.api_key = "http://127.0.0.1:8000/v1", "", ""
        self.rate, self.burstiness, self.concurrency = 4.0, 1.0, 8
        self.prompt_words, self.max_tokens, self.seed = (8, 96), (16, 128), 0
        self.clock = clock
        self.running = False
        self.stats = LoadStats()
        self.in_flight: dict[QNetworkReply, _Live] = {}
        self.backlog: deque[dict] = deque()
        self.nam = QNetworkAccessManager(self)
        self._rng = random.Random(0)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._arrive)

    # -- control ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.running:
            return
        self.running, self.stats, self._rng = True, LoadStats(), random.Random(self.seed)
        if self.model:
            self._schedule()
        else:  # ask the server what it serves, as most servers insist on a model name
            reply = self.nam.get(self._request("/models"))
            reply.finished.connect(lambda: self._got_models(reply))
        self.changed.emit()

    def stop(self) -> None:
        self.running = False
        self._timer.stop()
        self.backlog.clear()
        for reply in list(self.in_flight):
            reply.abort()  # its `finished` comes at once and takes it out of in_flight
        self.changed.emit()

    def _got_models(self, reply: QNetworkReply) -> None:
        reply.deleteLater()
        try:
            self.model = json.loads(bytes(reply.readAll()))["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            self.stats.on_failed(f"GET /models failed: {reply.errorString()}; give a model")
            self.stop()
            return
        if self.running:
            self._schedule()
        self.changed.emit()

    # -- arrivals --------------------------------------------------------------------------
    def make_body(self) -> dict:
        rng = self._rng
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*self.prompt_words)))
        return {"model": self.model, "prompt": prompt, "stream": True,
                "max_tokens": rng.randint(*self.max_tokens), "temperature": 0.8,
                "seed": rng.randrange(2**31), "ignore_eos": True,
                "stream_options": {"include_usage": True}}

    def _schedule(self) -> None:
        if self.running and self.rate > 0:
            gap = gamma_gap(self._rng, self.rate, self.burstiness)
            self._timer.start(max(1, round(1000 * gap)))

    def _arrive(self) -> None:
        if not self.running:
            return
        if len(self.backlog) < MAX_BACKLOG:
            self.backlog.append(self.make_body())
        self._fill()
        self._schedule()

    def _fill(self) -> None:
        while self.running and self.backlog and len(self.in_flight) < self.concurrency:
            self._send(self.backlog.popleft())
        self.changed.emit()

    def _request(self, path: str) -> QNetworkRequest:
        req = QNetworkRequest(QUrl(self.url.rstrip("/") + path))
        req.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
        if self.api_key:
            req.setRawHeader(b"Authorization", b"Bearer " + self.api_key.encode())
        return req

    def _send(self, body: dict) -> None:
        now = self.clock()
        self.stats.on_sent(now)
        reply = self.nam.post(self._request("/completions"), json.dumps(body).encode())
        self.in_flight[reply] = _Live(now)
        reply.readyRead.connect(lambda: self._read(reply))
        reply.finished.connect(lambda: self._finished(reply))

    # -- replies ---------------------------------------------------------------------------
    def _read(self, reply: QNetworkReply) -> None:
        live = self.in_flight.get(reply)
        if live is None:
            return
        live.buf += bytes(reply.readAll())
        *events, live.buf = live.buf.split(b"\n\n")
        now = self.clock()
        for event in events:
            _take_event(live, event.strip(), now)

    def _finished(self, reply: QNetworkReply) -> None:
        reply.deleteLater()
        live = self.in_flight.pop(reply, None)
        if live is None:
            return
        self._read_rest(reply, live)
        status = reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute)
        if reply.error() == QNetworkReply.NetworkError.OperationCanceledError:
            pass  # we stopped it
        elif live.error or reply.error() != QNetworkReply.NetworkError.NoError:
            self.stats.on_failed(f"HTTP {status}: {live.error or _error_text(live.buf)}"
                                 if status else reply.errorString())
        else:
            tokens = live.usage_tokens if live.usage_tokens is not None else live.chunks
            self.stats.on_done(self.clock(), live.first, live.gaps, tokens)
        self._fill()

    def _read_rest(self, reply: QNetworkReply, live: _Live) -> None:
        live.buf += bytes(reply.readAll())
        if live.buf.startswith(b"data:"):
            for event in live.buf.split(b"\n\n"):
                _take_event(live, event.strip(), self.clock())


def _take_event(live: _Live, event: bytes, now: float) -> None:
    if not event.startswith(b"data:") or event.endswith(b"[DONE]"):
        return
    try:
        chunk = json.loads(event[5:])
    except ValueError:
        return
    if "error" in chunk:
        live.error = str(chunk["error"].get("message", chunk["error"]))
    if chunk.get("usage"):
        live.usage_tokens = chunk["usage"].get("completion_tokens")
    choices = chunk.get("choices") or []
    if choices and choices[0].get("text"):
        live.chunks += 1
        if live.first is None:
            live.first = now - live.sent
        else:
            live.gaps.append(now - live.last)
        live.last = now


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


class OpenAILoadPanel(QGroupBox):
    """The URL load generator's settings, start button and live results."""

    def __init__(self, parent=None) -> None:
        super().__init__("… or drive any OpenAI-compatible URL", parent)
        self.load = OpenAILoad(self)
        self.url = QLineEdit(self.load.url)
        self.model = QLineEdit()
        self.model.setPlaceholderText("(ask the server)")
        self.api_key = QLineEdit()
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.rate = QDoubleSpinBox()
        self.rate.setRange(0.1, 500.0)
        self.rate.setValue(self.load.rate)
        self.rate.setSuffix(" req/s")
        self.burstiness = QDoubleSpinBox()
        self.burstiness.setRange(0.05, 20.0)
        self.burstiness.setValue(self.load.burstiness)
        self.burstiness.setToolTip("gamma shape: 1 = Poisson, < 1 burstier, > 1 more even")
        self.concurrency = QSpinBox()
        self.concurrency.setRange(1, 1024)
        self.concurrency.setValue(self.load.concurrency)
        self.button = QPushButton("Start URL load")
        self.button.setCheckable(True)
        self.button.toggled.connect(self._toggled)
        self.results = QLabel("")
        self.results.setWordWrap(True)  # the dock is narrow: wrap, never widen it
        form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        for name, w in (("base URL", self.url), ("model", self.model), ("API key", self.api_key),
                        ("rate", self.rate), ("burstiness", self.burstiness),
                        ("max concurrent", self.concurrency)):
            form.addRow(name, w)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.button)
        layout.addWidget(self.results)
        self.load.changed.connect(self.show_results)
        self.show_results()

    def apply_values(self, prompt_words=None, max_tokens=None, seed=None) -> None:
        g = self.load
        g.url, g.model, g.api_key = self.url.text().strip(), self.model.text().strip(), \
            self.api_key.text()
        g.rate, g.burstiness = self.rate.value(), self.burstiness.value()
        g.concurrency = self.concurrency.value()
        g.prompt_words = prompt_words or g.prompt_words
        g.max_tokens = max_tokens or g.max_tokens
        g.seed = g.seed if seed is None else seed

    def _toggled(self, on: bool) -> None:
        if on:
            self.apply_values()
            self.load.start()
        else:
            self.load.stop()

    def show_results(self) -> None:
        g = self.load
        if self.button.isChecked() != g.running:
            self.button.blockSignals(True)
            self.button.setChecked(g.running)
            self.button.blockSignals(False)
        self.button.setText("Stop URL load" if g.running else "Start URL load")
        errors = "\n".join(g.stats.errors)
        self.results.setText(f"in flight {len(g.in_flight)} · backlog {len(g.backlog)} · "
                             f"{g.stats.summary()}" + (f"\n{errors}" if errors else ""))
