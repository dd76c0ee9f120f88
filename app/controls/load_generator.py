"""Synthetic load: Poisson arrivals at a chosen rate, at most N chats in flight, random
prompt and reply lengths, all seeded, so the block map and plots come alive without typing."""
from __future__ import annotations

import random
from collections import deque

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.controls.openai_load import OpenAILoadPanel

WORDS = [
    "the", "cache", "keeps", "every", "layer", "key", "and", "value", "so", "each", "decode",
    "step", "only", "computes", "one", "new", "token", "while", "blocks", "of", "memory",
    "are", "handed", "out", "on", "demand", "and", "shared", "by", "prefix", "when", "two",
    "prompts", "begin", "alike", "scheduler", "batch", "prefill", "decode", "preempt",
    "recompute", "page", "table", "physical", "logical", "quantize", "scale", "budget",
    "throughput", "latency",
]
MAX_BACKLOG = 256


class LoadGenerator(QObject):
    submitRequested = Signal(str, object, object)  # request id, prompt text, sampling dict
    abortRequested = Signal(str)
    countsChanged = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.rate = 2.0  # arrivals per second
        self.concurrency = 8
        self.prompt_words = (8, 96)
        self.max_tokens = (16, 160)
        self.seed = 0
        self.running = False
        self.in_flight: set[str] = set()
        self.backlog: deque[tuple[str, str, dict]] = deque()
        self.done = self.failed = self.submitted = 0
        self._rng = random.Random(0)
        self._n = 0
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._arrive)

    def start(self) -> None:
        if self.running:
            return
        self.running = True
        self._rng = random.Random(self.seed)
        self._schedule()
        self.countsChanged.emit()

    def stop(self, abort: bool = True) -> None:
        """Stop arrivals; abort what is in flight (abort=False lets it finish)."""
        self.running = False
        self._timer.stop()
        self.backlog.clear()
        if abort:
            for rid in sorted(self.in_flight):
                self.abortRequested.emit(rid)
        self.countsChanged.emit()

    def make_request(self) -> tuple[str, str, dict]:
        rng = self._rng
        self._n += 1
        words = rng.randint(*self.prompt_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        sampling = {"max_tokens": rng.randint(*self.max_tokens), "temperature": 0.8,
                    "seed": rng.randrange(2**31), "ignore_eos": True}
        return f"load-{self.seed}-{self._n}", prompt, sampling

    def _schedule(self) -> None:
        if self.running and self.rate > 0:
            self._timer.start(max(1, round(1000 * self._rng.expovariate(self.rate))))

    def _arrive(self) -> None:
        if not self.running:
            return
        if len(self.backlog) < MAX_BACKLOG:
            self.backlog.append(self.make_request())
        self._fill()
        self._schedule()

    def _fill(self) -> None:
        while self.running and self.backlog and len(self.in_flight) < self.concurrency:
            rid, prompt, sampling = self.backlog.popleft()
            self.in_flight.add(rid)
            self.submitted += 1
            self.submitRequested.emit(rid, prompt, sampling)
        self.countsChanged.emit()

    # -- engine facts -----------------------------------------------------------------------
    def on_deltas(self, deltas: list) -> None:
        changed = False
        for d in deltas:
            if d.finished and d.request_id in self.in_flight:
                self.in_flight.discard(d.request_id)
                self.done += 1
                changed = True
        if changed:
            self._fill()

    def on_submit_failed(self, request_id: str, _message: str) -> None:
        if request_id in self.in_flight:
            self.in_flight.discard(request_id)
            self.failed += 1
            self._fill()

    def fail_all(self) -> None:
        self.failed += len(self.in_flight)
        self.in_flight.clear()
        self.stop(abort=False)


class LoadGeneratorPanel(QWidget):
    def __init__(self, generator: LoadGenerator, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.generator = generator
        self.rate = QDoubleSpinBox()
        self.rate.setRange(0.1, 200.0)
        self.rate.setValue(generator.rate)
        self.rate.setSuffix(" req/s")
        self.concurrency = QSpinBox()
        self.concurrency.setRange(1, 1024)
        self.concurrency.setValue(generator.concurrency)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.prompt_min, self.prompt_max = _range_boxes(generator.prompt_words, 4096)
        self.tokens_min, self.tokens_max = _range_boxes(generator.max_tokens, 8192)
        self.button = QPushButton("Start load")
        self.button.setObjectName("loadButton")
        self.button.setCheckable(True)
        self.button.toggled.connect(self._toggled)
        self.counts = QLabel("")
        self.counts.setWordWrap(True)  # the dock is narrow: wrap, never widen it
        form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        form.addRow("arrival rate (Poisson)", self.rate)
        form.addRow("max concurrent chats", self.concurrency)
        form.addRow("prompt words", _pair(self.prompt_min, self.prompt_max))
        form.addRow("reply tokens", _pair(self.tokens_min, self.tokens_max))
        form.addRow("seed", self.seed)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.button)
        layout.addWidget(self.counts)
        self.url_load = OpenAILoadPanel()  # the same knobs, aimed at an HTTP server
        layout.addWidget(self.url_load)
        layout.addStretch(1)
        generator.countsChanged.connect(self.show_counts)
        self.show_counts()

    def apply_values(self) -> None:
        g = self.generator
        g.rate, g.concurrency, g.seed = self.rate.value(), self.concurrency.value(), \
            self.seed.value()
        g.prompt_words = _ordered(self.prompt_min.value(), self.prompt_max.value())
        g.max_tokens = _ordered(self.tokens_min.value(), self.tokens_max.value())
        self.url_load.load.prompt_words, self.url_load.load.max_tokens = \
            g.prompt_words, g.max_tokens

    def _toggled(self, on: bool) -> None:
        if on:
            self.apply_values()
            self.generator.start()
        else:
            self.generator.stop()

    def set_running(self, on: bool) -> None:
        self.button.setChecked(on)

    def show_counts(self) -> None:
        g = self.generator
        if self.button.isChecked() != g.running:
            self.button.blockSignals(True)
            self.button.setChecked(g.running)
            self.button.blockSignals(False)
        self.button.setText("Stop load" if g.running else "Start load")
        self.counts.setText(f"in flight {len(g.in_flight)} · backlog {len(g.backlog)} · "
                            f"done {g.done} · failed {g.failed}")


def _range_boxes(values: tuple[int, int], top: int) -> tuple[QSpinBox, QSpinBox]:
    boxes = []
    for v in values:
        box = QSpinBox()
        box.setRange(1, top)
        box.setValue(v)
        boxes.append(box)
    return boxes[0], boxes[1]


def _pair(a: QWidget, b: QWidget) -> QWidget:
    w = QWidget()
    row = QHBoxLayout(w)
    row.setContentsMargins(0, 0, 0, 0)
    row.addWidget(a)
    row.addWidget(QLabel("to"))
    row.addWidget(b)
    return w


def _ordered(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a <= b else (b, a)
