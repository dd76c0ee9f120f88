"""KV calculator: a model config (the running one, a preset or a config.json), a dtype and a
context length -> bytes per token and in total; what fits in the memory this device has left
after the weights (tokens per KV dtype and block size, concurrent requests of a length); and
reserving max length vs paging for a seeded distribution of request lengths."""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor, QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QAbstractScrollArea,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHeaderView,
    QLabel,
    QScrollArea,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app import kv_math
from app.fmt import human_bytes

RUNNING = "Running engine"
FROM_FILE = "config.json…"
THIS_DEVICE = "this device"
MANUAL = "manual"
SHOW_TOKENS = "tokens that fit"
SHOW_REQUESTS = "concurrent requests"
# Table rows: KV dtypes that take the same bytes per token share a row.
FIT_ROWS = (("fp32", ("float32",)), ("bf16/fp16", ("bfloat16", "float16")),
            ("int8/fp8", ("int8", "fp8")))
ENGINE_CELL = QColor(46, 82, 120)
GiB = 1 << 30


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
        self.dtype = QComboBox()
        self.dtype.addItems(list(kv_math.DTYPE_BYTES))
        self.dtype.setCurrentText("bfloat16")
        self.context = _spin(1, 10_000_000, 4096)
        self.context.setSingleStep(1024)
        self.per_token = QLabel()
        self.per_token.setObjectName("kvPerToken")
        self.per_token.setWordWrap(True)  # the side dock is narrow
        self.engine_note = QLabel()
        self.engine_note.setObjectName("note")
        self.engine_note.setWordWrap(True)
        model_box = QGroupBox("Model and dtype")
        form = QFormLayout(model_box)
        form.addRow("model", self.source)
        form.addRow("layers", self.layers)
        form.addRow("KV heads", self.kv_heads)
        form.addRow("head dim", self.head_dim)
        form.addRow("KV dtype", self.dtype)
        form.addRow("context length", self.context)
        form.addRow(self.per_token)
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
        fits_box = self._build_fits()
        inner = QWidget()
        inner.setObjectName("kvCalculatorContents")
        column = QVBoxLayout(inner)
        column.addWidget(model_box)
        column.addWidget(fits_box)
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
        for w in (self.layers, self.kv_heads, self.head_dim, self.context, self.requests,
                  self.mean, self.seed):
            w.valueChanged.connect(self.recompute)
        for w in (self.dtype, self.dist, self.block_size):
            w.currentTextChanged.connect(self.recompute)
        # A new dtype or block size in the calculator: the line follows it again.
        self.dtype.currentTextChanged.connect(self._follow_calculator)
        self.block_size.currentTextChanged.connect(self._follow_calculator)
        self.recompute()

    def _build_fits(self) -> QGroupBox:
        self.device_frame = None
        self.engine_block_size: int | None = None
        self.engine_max_seqs: int | None = None
        self._cell_chosen = False  # the user picked a table cell: the line follows it
        self._setting_cell = False
        self.fits_source = QComboBox()
        self.fits_source.addItems([THIS_DEVICE, MANUAL])
        self.fits_source.setToolTip("this device: the engine's free memory, from its device "
                                    "frames; manual: an amount you type")
        self.manual_gib = QDoubleSpinBox()
        self.manual_gib.setRange(0.0, 1_000_000.0)
        self.manual_gib.setDecimals(1)
        self.manual_gib.setValue(16.0)
        self.manual_gib.setSuffix(" GiB")
        self.manual_gib.setToolTip("memory for the KV cache, taken as is (no headroom); "
                                   "typing here switches to manual")
        self.headroom = QDoubleSpinBox()
        self.headroom.setRange(0.0, 90.0)
        self.headroom.setDecimals(1)
        self.headroom.setValue(100 * kv_math.DEFAULT_HEADROOM_FRAC)
        self.headroom.setSuffix(" %")
        self.headroom.setToolTip("of the device's total memory, kept for activations, the "
                                 "allocator's slack and other programs")
        self.request_len = _spin(1, 10_000_000, 4096)
        self.request_len.setSingleStep(1024)
        self.request_len.setToolTip("prompt + reply tokens of each request")
        self.fits_show = QComboBox()
        self.fits_show.addItems([SHOW_TOKENS, SHOW_REQUESTS])
        self.fits_memory = QLabel()
        self.fits_memory.setObjectName("kvFitsMemory")
        self.fits_memory.setWordWrap(True)
        self.fits_memory.setTextFormat(Qt.TextFormat.RichText)
        self.fits_table = QTableWidget(len(FIT_ROWS), len(kv_math.FIT_BLOCK_SIZES))
        self.fits_table.setObjectName("kvFitsTable")
        t = self.fits_table
        t.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        t.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        t.setHorizontalHeaderLabels([str(bs) for bs in kv_math.FIT_BLOCK_SIZES])
        t.setVerticalHeaderLabels([label for label, _ in FIT_ROWS])
        t.horizontalHeaderItem(0).setToolTip("block size (tokens)")
        t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        t.horizontalHeader().setMinimumSectionSize(36)
        t.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        t.horizontalHeader().setHighlightSections(False)
        t.verticalHeader().setHighlightSections(False)
        for r, (_label, dtypes) in enumerate(FIT_ROWS):
            t.verticalHeaderItem(r).setToolTip(" and ".join(dtypes))
        t.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        t.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        t.setSizeAdjustPolicy(QAbstractScrollArea.SizeAdjustPolicy.AdjustToContents)
        t.setWordWrap(False)
        t.setTextElideMode(Qt.TextElideMode.ElideNone)
        for r in range(t.rowCount()):
            for c in range(t.columnCount()):
                item = QTableWidgetItem("—")
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                t.setItem(r, c, item)
        self.fits_line = QLabel()
        self.fits_line.setObjectName("kvFitsLine")
        self.fits_line.setWordWrap(True)
        note = QLabel("rows: KV dtype · columns: block size · only whole blocks fit; the "
                      "running engine's setting is shaded")
        note.setObjectName("note")
        note.setWordWrap(True)
        box = QGroupBox("What fits on this device")
        form = QFormLayout(box)
        form.addRow("memory", self.fits_source)
        form.addRow("manual amount", self.manual_gib)
        form.addRow("headroom", self.headroom)
        form.addRow(self.fits_memory)
        form.addRow("request length", self.request_len)
        form.addRow("table shows", self.fits_show)
        form.addRow(t)
        form.addRow(note)
        form.addRow(self.fits_line)
        self.fits_source.currentTextChanged.connect(self._update_fits)
        self.fits_show.currentTextChanged.connect(self._update_fits)
        self.manual_gib.valueChanged.connect(self._manual_edited)
        self.headroom.valueChanged.connect(self._update_fits)
        self.request_len.valueChanged.connect(self._update_fits)
        t.currentCellChanged.connect(self._cell_changed)
        return box

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
        self.recompute()

    def set_engine_block_size(self, block_size: int | None) -> None:
        """The running engine's KV block size (stats frame: engine["block_size"])."""
        block_size = block_size if isinstance(block_size, int) and block_size > 0 else None
        if block_size != self.engine_block_size:
            self.engine_block_size = block_size
            self._update_fits()

    def set_engine_max_seqs(self, max_seqs: int | None) -> None:
        """The engine's max_num_seqs: memory may hold more requests than it runs at once."""
        max_seqs = max_seqs if isinstance(max_seqs, int) and max_seqs > 0 else None
        if max_seqs != self.engine_max_seqs:
            self.engine_max_seqs = max_seqs
            self._update_fits()

    def set_device(self, frame) -> None:
        """The engine's latest ipc.messages.DeviceFrame (about once a second), or None when
        there is no engine. Only numbers change: no widget is rebuilt, focus and the user's
        inputs stay as they are."""
        self.device_frame = frame
        self._update_fits()

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

    def shape(self) -> kv_math.ModelShape:
        return kv_math.ModelShape(self.layers.value(), self.kv_heads.value(),
                                  self.head_dim.value())

    # -- results ----------------------------------------------------------------------------
    def recompute(self) -> None:
        dtype = self.dtype.currentText()
        per = kv_math.bytes_per_token(self.shape(), dtype)
        ctx = self.context.value()
        self.per_token.setText(f"<b>{human_bytes(per)}</b> per token ({per:,} B) · "
                               f"<b>{human_bytes(per * ctx)}</b> for {ctx:,} tokens")
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
        self.last = (per, c)
        self._update_fits()

    # -- what fits ----------------------------------------------------------------------------
    def fits_available(self) -> tuple[int, str]:
        """(bytes for the KV cache, how they were found) from the device frame or by hand."""
        manual = int(self.manual_gib.value() * GiB)
        if self.fits_source.currentText() == MANUAL:
            return manual, f"manual: <b>{human_bytes(manual)}</b> for the KV cache"
        f = self.device_frame
        if f is None:
            return manual, (f"no device report from an engine yet: using the manual "
                            f"<b>{human_bytes(manual)}</b>")
        dev = getattr(f, "device", None) or "device"
        free = getattr(f, "memory_free", None)
        if free is None:
            return manual, (f"{dev} reports no free memory: using the manual "
                            f"<b>{human_bytes(manual)}</b>")
        pool = getattr(f, "kv_pool_bytes", None) or 0
        total = getattr(f, "memory_total", None) or 0
        frac = self.headroom.value() / 100
        avail = kv_math.kv_memory_available(free, pool, total, frac)
        text = f"{dev} · {human_bytes(free)} free + {human_bytes(pool)} KV pool"
        if total:
            text += f" − {human_bytes(int(frac * total))} headroom"
        text += f"<br>= <b>{human_bytes(avail)}</b> for the KV cache"
        weights = getattr(f, "weights_bytes", None)
        if weights:
            text += f" (weights {human_bytes(weights)} already loaded)"
        return avail, text

    def _default_cell(self) -> tuple[str, int]:
        bs = self.engine_block_size or int(self.block_size.currentText())
        return self.dtype.currentText(), bs

    def fits_choice(self) -> tuple[str, int]:
        """(KV dtype, block size) of the concurrency line: the table cell the user picked,
        else the calculator's dtype and the engine's (or the calculator's) block size."""
        r, c = self.fits_table.currentRow(), self.fits_table.currentColumn()
        if self._cell_chosen and r >= 0 and c >= 0:
            dtypes = FIT_ROWS[r][1]
            dtype = self.dtype.currentText()
            return (dtype if dtype in dtypes else dtypes[0]), kv_math.FIT_BLOCK_SIZES[c]
        return self._default_cell()

    def _update_fits(self) -> None:
        if not hasattr(self, "last"):
            return  # still building
        shape = self.shape()
        avail, text = self.fits_available()
        manual = self.fits_source.currentText() == MANUAL or self.device_frame is None
        if self.headroom.isEnabled() == manual:
            self.headroom.setEnabled(not manual)  # it applies to the device's memory only
        _set_text(self.fits_memory, text)
        length = self.request_len.value()
        show_requests = self.fits_show.currentText() == SHOW_REQUESTS
        engine = (self.engine_kv_dtype, self.engine_block_size)
        table = kv_math.what_fits(avail, shape)
        for r, (_label, dtypes) in enumerate(FIT_ROWS):
            for c, bs in enumerate(kv_math.FIT_BLOCK_SIZES):
                f = table[dtypes[0]][bs]
                n = f.blocks // kv_math.blocks_per_request(length, bs)
                item = self.fits_table.item(r, c)
                text = _count(n) if show_requests else _count(f.tokens)
                if item.text() != text:
                    item.setText(text)
                tip = (f"{' / '.join(dtypes)}, block {bs}: {f.tokens:,} tokens in "
                       f"{f.blocks:,} blocks ({human_bytes(f.bytes_per_token)} per token); "
                       f"{n:,} requests of {length:,} tokens at once")
                is_engine = engine[0] in dtypes and engine[1] == bs
                if is_engine:
                    tip += " · the running engine's setting"
                if item.toolTip() != tip:
                    item.setToolTip(tip)
                if (item.data(Qt.ItemDataRole.UserRole) or False) != is_engine:
                    item.setData(Qt.ItemDataRole.UserRole, is_engine)
                    item.setBackground(QBrush(ENGINE_CELL) if is_engine else QBrush())
                    font = QFont(item.font())
                    font.setBold(is_engine)
                    item.setFont(font)
        if not self._cell_chosen:
            self._select_default_cell()
        dtype, bs = self.fits_choice()
        n = kv_math.concurrent_requests(avail, shape, dtype, bs, length)
        tokens = kv_math.fit(avail, shape, dtype, bs).tokens
        name = dtype
        if dtype != self.dtype.currentText():  # a row of the table: all its dtypes
            name = " / ".join(next(d for _, d in FIT_ROWS if dtype in d))
        cap = ""
        if self.engine_max_seqs is not None and n > self.engine_max_seqs:
            cap = (f"; the engine runs at most {self.engine_max_seqs:,} at once "
                   f"(max sequences)")
        _set_text(self.fits_line,
                  f"<b>{n:,}</b> concurrent requests of {length:,} tokens at {name}, "
                  f"block {bs} ({tokens:,} tokens in all){cap}")

    def _select_default_cell(self) -> None:
        dtype, bs = self._default_cell()
        row = next((r for r, (_, d) in enumerate(FIT_ROWS) if dtype in d), -1)
        col = kv_math.FIT_BLOCK_SIZES.index(bs) if bs in kv_math.FIT_BLOCK_SIZES else -1
        if (row, col) == (self.fits_table.currentRow(), self.fits_table.currentColumn()):
            return
        self._setting_cell = True
        try:
            if row < 0 or col < 0:
                self.fits_table.setCurrentItem(None)
            else:
                self.fits_table.setCurrentCell(row, col)
        finally:
            self._setting_cell = False

    def _cell_changed(self, row: int, col: int, _prev_row: int, _prev_col: int) -> None:
        if self._setting_cell:
            return
        self._cell_chosen = row >= 0 and col >= 0
        self._update_fits()

    def _follow_calculator(self) -> None:
        self._cell_chosen = False
        self._update_fits()

    def _manual_edited(self) -> None:
        """Typing an amount is an override: it wins over the device frames until the user
        picks "this device" again."""
        if self.fits_source.currentText() != MANUAL:
            self.fits_source.setCurrentText(MANUAL)  # -> _update_fits
        else:
            self._update_fits()


def _count(n: int) -> str:
    """1234 -> "1234", 491520 -> "492k", 1234567 -> "1.23M" (narrow table cells)."""
    if n < 10_000:
        return str(n)
    for div, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G")):
        v = n / div
        digits = 2 if v < 10 else 1 if v < 100 else 0
        if round(v, digits) < 1000 or unit == "G":
            return f"{v:.{digits}f}{unit}"
    return str(n)


def _set_text(label: QLabel, text: str) -> None:
    if label.text() != text:
        label.setText(text)


def _spin(lo: int, hi: int, value: int) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    box.setValue(value)
    box.setGroupSeparatorShown(True)
    return box

