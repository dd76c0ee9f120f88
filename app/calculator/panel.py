"""KV calculator: a model config (the running one, a preset or a config.json), a dtype and a
context length -> bytes per token and in total; what fits on this device (what_fits.py);
and reserving max length vs paging for a seeded distribution of request lengths."""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QGroupBox,
    QLabel,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.calculator import accuracy, kv_math
from kvscope.app.calculator.what_fits import WhatFitsBox
from kvscope.app.fmt import human_bytes
from kvscope.app.kv_grid.panel import KVGridBox

RUNNING = "Running engine"
EMBEDDED = "SmolLM2-135M (embedded)"
FROM_FILE = "config.json…"


class KVCalculatorPanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.running_shape: kv_math.ModelShape | None = None
        self.engine_bytes_per_token: int | None = None
        self.engine_kv_dtype: str | None = None
        self.source = QComboBox()
        self.source.addItems([RUNNING, *kv_math.PRESETS, FROM_FILE])
        self.source.activated.connect(lambda _i: self._source_chosen())
        self.layers = _spin(1, 1000, 30)
        self.kv_heads = _spin(1, 1024, 3)
        self.head_dim = _spin(1, 4096, 64)
        # Sliding windows (from a config.json; 0 = global attention everywhere).
        self.window = _spin(0, 10_000_000, 0)
        self.window.setToolTip("sliding window in tokens (0: every layer attends globally)")
        self.windowed_layers = _spin(0, 1000, 0)
        self.windowed_layers.setToolTip("layers that slide the window; all of them: the "
                                        "engine frees blocks behind it")
        self.window_info = QLabel()
        self.window_info.setObjectName("kvWindowNote")
        self.window_info.setWordWrap(True)
        self.dtype = QComboBox()
        self.dtype.addItems(list(kv_math.DTYPE_BYTES))
        self.dtype.setCurrentText("bfloat16")
        self.context = _spin(1, 10_000_000, 4096)
        self.context.setSingleStep(1024)
        self.per_token = QLabel()
        self.per_token.setObjectName("kvPerToken")
        self.per_token.setWordWrap(True)  # the side dock is narrow
        self.accuracy = QLabel()
        self.accuracy.setObjectName("note")
        self.accuracy.setWordWrap(True)
        self.engine_note = QLabel()
        self.engine_note.setObjectName("note")
        self.engine_note.setWordWrap(True)
        model_box = QGroupBox("Model and dtype")
        form = QFormLayout(model_box)
        form.addRow("model", self.source)
        form.addRow("layers", self.layers)
        form.addRow("KV heads", self.kv_heads)
        form.addRow("head dim", self.head_dim)
        form.addRow("sliding window", self.window)
        form.addRow("windowed layers", self.windowed_layers)
        form.addRow("KV dtype", self.dtype)
        form.addRow("context length", self.context)
        form.addRow(self.per_token)
        form.addRow(self.window_info)
        form.addRow(self.accuracy)
        form.addRow(self.engine_note)

        self.requests = _spin(1, 100_000, 64)
        self.dist = QComboBox()
        self.dist.addItems(list(kv_math.DISTRIBUTIONS))
        self.dist.setCurrentText("lognormal")
        self.mean = _spin(1, 10_000_000, 700)
        self.block_size = QComboBox()
        self.block_size.addItems([str(2**i) for i in range(9)])
        self.block_size.setCurrentText("16")
        self.seed = _spin(0, 2**31 - 1, 0)
        self.comparison = QLabel()
        self.comparison.setObjectName("kvComparison")
        self.comparison.setWordWrap(True)
        cmp_box = QGroupBox("Reserve max length vs paged blocks")
        form2 = QFormLayout(cmp_box)
        form2.addRow("requests", self.requests)
        form2.addRow("length distribution", self.dist)
        form2.addRow("mean length (tokens)", self.mean)
        form2.addRow("block size", self.block_size)
        form2.addRow("seed", self.seed)
        form2.addRow(self.comparison)
        self.fits = WhatFitsBox()
        inner = QWidget()
        inner.setObjectName("kvCalculatorContents")
        column = QVBoxLayout(inner)
        column.addWidget(model_box)
        self.kv_grid = KVGridBox()  # the measured long-context grid per KV dtype
        column.addWidget(self.kv_grid)
        column.addWidget(self.fits)
        column.addWidget(cmp_box)
        column.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setWidget(inner)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.scroll)
        for w in (self.layers, self.kv_heads, self.head_dim, self.window,
                  self.windowed_layers, self.context, self.requests, self.mean, self.seed):
            w.valueChanged.connect(self.recompute)
        for w in (self.dtype, self.dist, self.block_size):
            w.currentTextChanged.connect(self.recompute)
        self.recompute()

    # -- model source ---------------------------------------------------------------------------
    def set_running_model(self, model: str) -> None:
        """The engine's --model: "default", a checkpoint folder or a file."""
        shape = None
        if model == "default":
            shape = kv_math.ModelShape(*kv_math.PRESETS["SmolLM2-135M (embedded)"])
        else:
            path = Path(model)
            path = path / "config.json" if path.is_dir() else path.with_name("config.json")
            try:
                shape = kv_math.shape_from_config(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                shape = None  # remote engine or a GGUF: use a preset or a config.json
        self.running_shape = shape
        if self.source.currentText() == RUNNING:
            self._source_chosen()

    def set_engine_kv(self, bytes_per_token: int | None, kv_dtype: str | None) -> None:
        if (bytes_per_token, kv_dtype) == (self.engine_bytes_per_token, self.engine_kv_dtype):
            return  # every stats frame: nothing new
        self.engine_bytes_per_token, self.engine_kv_dtype = bytes_per_token, kv_dtype
        self.fits.set_engine_kv_dtype(kv_dtype)
        self.recompute()

    def _source_chosen(self) -> None:
        name = self.source.currentText()
        if name == RUNNING:
            if self.running_shape is not None:
                self.set_shape(self.running_shape)
            if self.engine_kv_dtype in kv_math.DTYPE_BYTES:
                self.dtype.setCurrentText(self.engine_kv_dtype)
        elif name == FROM_FILE:
            path, _ = QFileDialog.getOpenFileName(self, "Model config.json", "",
                                                  "config.json (*.json)")
            if path:
                self.load_config_file(path)
        else:
            self.set_shape(kv_math.ModelShape(*kv_math.PRESETS[name]))

    def load_config_file(self, path: str) -> bool:
        try:
            self.set_shape(kv_math.shape_from_config(json.loads(Path(path).read_text())))
        except (OSError, ValueError, KeyError) as exc:
            self.engine_note.setText(f"cannot read {path}: {exc}")
            return False
        return True

    def set_shape(self, shape: kv_math.ModelShape) -> None:
        self.layers.setValue(shape.layers)
        self.kv_heads.setValue(shape.kv_heads)
        self.head_dim.setValue(shape.head_dim)
        self.window.setValue(shape.window)
        self.windowed_layers.setValue(shape.windowed_layers)

    def other_model(self) -> str | None:
        """The preset chosen when it is not the model the engine runs (None otherwise)."""
        name = self.source.currentText()
        if name in (RUNNING, FROM_FILE) or name not in kv_math.PRESETS:
            return None
        if self.running_shape == kv_math.ModelShape(*kv_math.PRESETS[name]):
            return None
        return name

    def accuracy_note(self, dtype: str) -> str:
        """The measured KV accuracy applies to the embedded model only: say so elsewhere."""
        other = self.other_model()
        if other is None or other == EMBEDDED:
            return accuracy.hint(dtype)
        return (f"KV accuracy was measured on {accuracy.MODEL} only (see its hints under "
                f"the running engine); {other} may differ")

    def shape(self) -> kv_math.ModelShape:
        window = self.window.value()
        windowed = min(self.windowed_layers.value(), self.layers.value()) if window else 0
        return kv_math.ModelShape(self.layers.value(), self.kv_heads.value(),
                                  self.head_dim.value(), windowed, window if windowed else 0)

    # -- results ----------------------------------------------------------------------------
    def recompute(self) -> None:
        dtype = self.dtype.currentText()
        per = kv_math.bytes_per_token(self.shape(), dtype)
        ctx = self.context.value()
        shape = self.shape()
        held = kv_math.sequence_tokens_held(shape, ctx)
        self.per_token.setText(f"<b>{human_bytes(per)}</b> per token ({per:,} B) · "
                               f"<b>{human_bytes(per * held)}</b> for {ctx:,} tokens")
        self.window_info.setText(kv_math.window_note(shape, ctx))
        self.window_info.setVisible(bool(self.window_info.text()))
        self.accuracy.setText(self.accuracy_note(dtype))
        self.kv_grid.highlight(dtype)
        if self.engine_bytes_per_token:
            self.engine_note.setText(f"the running engine reports "
                                     f"{self.engine_bytes_per_token:,} B per token "
                                     f"(KV {self.engine_kv_dtype})")
        lengths = kv_math.sample_lengths(self.dist.currentText(), self.mean.value(), ctx,
                                         self.requests.value(), self.seed.value())
        c = kv_math.compare(lengths, ctx, int(self.block_size.currentText()))
        self.comparison.setText(
            f"{len(lengths)} requests, {c.used_slots:,} tokens in use<br>"
            f"reserve {ctx:,} each: <b>{human_bytes(c.reserved_slots * per)}</b>, "
            f"<b>{100 * c.reserved_waste:.1f} %</b> wasted<br>"
            f"paged: <b>{human_bytes(c.paged_slots * per)}</b>, "
            f"<b>{100 * c.paged_waste:.1f} %</b> wasted (last block of each request)")
        other = self.other_model()
        self.fits.set_other_model(other, kv_math.preset_weights_bytes(other) if other else None)
        self.fits.set_model(self.shape(), dtype, int(self.block_size.currentText()))


def _spin(lo: int, hi: int, value: int) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    box.setValue(value)
    box.setGroupSeparatorShown(True)
    return box

