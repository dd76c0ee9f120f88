"""The KV calculator's "what fits on this device": the memory the KV cache could take once the
weights are loaded (from the engine's device frames, or an amount typed in), as tokens per KV
dtype and block size or as concurrent requests of a length. The calculator hands it the model
shape and its own dtype and block size; the window hands it device frames and engine facts."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor, QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QAbstractScrollArea,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHeaderView,
    QLabel,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QWidget,
)

from kvscope.app.calculator import accuracy, kv_math
from kvscope.app.fmt import human_bytes

THIS_DEVICE = "this device"
MANUAL = "manual"
SHOW_TOKENS = "tokens that fit"
SHOW_REQUESTS = "concurrent requests"
# Table rows: KV dtypes that take the same bytes per token share a row.
FIT_ROWS = (("fp32", ("float32",)), ("bf16/fp16", ("bfloat16", "float16")),
            ("int8/fp8", ("int8", "fp8")))
ENGINE_CELL = QColor(46, 82, 120)
GiB = 1 << 30


class WhatFitsBox(QGroupBox):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("What fits on this device", parent)
        self.shape = kv_math.ModelShape(*kv_math.PRESETS["SmolLM2-135M (embedded)"])
        self.dtype, self.block_size = "bfloat16", 16  # the calculator's choices
        self.device_frame = None
        self.engine_kv_dtype: str | None = None
        self.engine_block_size: int | None = None
        self.engine_max_seqs: int | None = None
        # Another model than the running one: (its name, its weights' bytes); None: running.
        self.other_model: tuple[str, int] | None = None
        self._cell_chosen = False  # the user picked a table cell: the line follows it
        self._setting_cell = False
        self.source = QComboBox()
        self.source.addItems([THIS_DEVICE, MANUAL])
        self.source.setToolTip("this device: the engine's free memory, from its device "
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
        self.request_len = QSpinBox()
        self.request_len.setRange(1, 10_000_000)
        self.request_len.setValue(4096)
        self.request_len.setGroupSeparatorShown(True)
        self.request_len.setSingleStep(1024)
        self.request_len.setToolTip("prompt + reply tokens of each request")
        self.table_shows = QComboBox()
        self.table_shows.addItems([SHOW_TOKENS, SHOW_REQUESTS])
        self.memory = QLabel()
        self.memory.setObjectName("kvFitsMemory")
        self.memory.setWordWrap(True)
        self.memory.setTextFormat(Qt.TextFormat.RichText)
        self.table = _fits_table()
        self.line = QLabel()
        self.line.setObjectName("kvFitsLine")
        self.line.setWordWrap(True)
        note = QLabel("rows: KV dtype · columns: block size · only whole blocks fit; the "
                      "running engine's setting is shaded")
        note.setObjectName("note")
        note.setWordWrap(True)
        form = QFormLayout(self)
        form.addRow("memory", self.source)
        form.addRow("manual amount", self.manual_gib)
        form.addRow("headroom", self.headroom)
        form.addRow(self.memory)
        form.addRow("request length", self.request_len)
        form.addRow("table shows", self.table_shows)
        form.addRow(self.table)
        form.addRow(note)
        form.addRow(self.line)
        for combo in (self.source, self.table_shows):
            combo.currentTextChanged.connect(self.recompute)
        for spin in (self.headroom, self.request_len):
            spin.valueChanged.connect(self.recompute)
        self.manual_gib.valueChanged.connect(self._manual_edited)
        self.table.currentCellChanged.connect(self._cell_changed)
        self.recompute()

    # -- inputs -------------------------------------------------------------------------------
    def set_model(self, shape: kv_math.ModelShape, dtype: str, block_size: int) -> None:
        """The calculator's model, KV dtype and block size. A new dtype or block size there
        makes the concurrency line follow the calculator again."""
        if (dtype, block_size) != (self.dtype, self.block_size):
            self._cell_chosen = False
        self.shape, self.dtype, self.block_size = shape, dtype, block_size
        self.recompute()

    def set_other_model(self, name: str | None, weights_bytes: int | None) -> None:
        """The calculator shows another model than the running one: its weights replace the
        loaded ones in this device's memory (None: the running model's, as loaded)."""
        other = (name, weights_bytes) if name and weights_bytes else None
        if other != self.other_model:
            self.other_model = other
            self.recompute()

    def set_device(self, frame) -> None:
        """The engine's latest ipc.messages.DeviceFrame (about once a second), or None when
        there is no engine. Only numbers change: no widget is rebuilt, focus and the user's
        inputs stay as they are."""
        self.device_frame = frame
        self.recompute()

    def set_engine_kv_dtype(self, kv_dtype: str | None) -> None:
        if kv_dtype != self.engine_kv_dtype:
            self.engine_kv_dtype = kv_dtype
            self.recompute()

    def set_engine_block_size(self, block_size: int | None) -> None:
        """The running engine's KV block size (StatsFrame.engine.block_size)."""
        block_size = block_size if isinstance(block_size, int) and block_size > 0 else None
        if block_size != self.engine_block_size:
            self.engine_block_size = block_size
            self.recompute()

    def set_engine_max_seqs(self, max_seqs: int | None) -> None:
        """The engine's max_num_seqs: memory may hold more requests than it runs at once."""
        max_seqs = max_seqs if isinstance(max_seqs, int) and max_seqs > 0 else None
        if max_seqs != self.engine_max_seqs:
            self.engine_max_seqs = max_seqs
            self.recompute()

    # -- results ------------------------------------------------------------------------------
    def available(self) -> tuple[int, str]:
        """(bytes for the KV cache, how they were found) from the device frame or by hand."""
        manual = int(self.manual_gib.value() * GiB)
        if self.source.currentText() == MANUAL:
            return manual, f"manual: <b>{human_bytes(manual)}</b> for the KV cache"
        f = self.device_frame
        if f is None:
            return manual, (f"no device report from an engine yet: using the manual "
                            f"<b>{human_bytes(manual)}</b>")
        frac = self.headroom.value() / 100
        avail = kv_math.kv_memory_available(f.memory_free, f.kv_pool_bytes, f.memory_total,
                                            frac)
        head = (f"{f.device} · {human_bytes(f.memory_free)} free + "
                f"{human_bytes(f.kv_pool_bytes)} KV pool − "
                f"{human_bytes(int(frac * f.memory_total))} headroom")
        if self.other_model is not None:
            name, weights = self.other_model
            avail = kv_math.swap_weights(avail, f.weights_bytes, weights)
            return avail, (f"{head} + {human_bytes(f.weights_bytes)} running model's weights "
                           f"− {human_bytes(weights)} {name} weights (bf16)<br>"
                           f"= <b>{human_bytes(avail)}</b> for the KV cache")
        return avail, (f"{head}<br>= <b>{human_bytes(avail)}</b> for the KV cache (weights "
                       f"{human_bytes(f.weights_bytes)} already loaded)")

    def choice(self) -> tuple[str, int]:
        """(KV dtype, block size) of the concurrency line: the table cell the user picked,
        else the calculator's dtype and the engine's (or the calculator's) block size."""
        r, c = self.table.currentRow(), self.table.currentColumn()
        if self._cell_chosen and r >= 0 and c >= 0:
            dtypes = FIT_ROWS[r][1]
            return (self.dtype if self.dtype in dtypes else dtypes[0]), \
                kv_math.FIT_BLOCK_SIZES[c]
        return self._default_cell()

    def _default_cell(self) -> tuple[str, int]:
        return self.dtype, self.engine_block_size or self.block_size

    def recompute(self) -> None:
        avail, text = self.available()
        manual = self.source.currentText() == MANUAL or self.device_frame is None
        if self.headroom.isEnabled() == manual:
            self.headroom.setEnabled(not manual)  # it applies to the device's memory only
        _set_text(self.memory, text)
        self._fill_table(avail)
        if not self._cell_chosen:
            self._select_default_cell()
        self._show_line(avail)

    def _fill_table(self, avail: int) -> None:
        length = self.request_len.value()
        show_requests = self.table_shows.currentText() == SHOW_REQUESTS
        table = kv_math.what_fits(avail, self.shape)
        for r, (_label, dtypes) in enumerate(FIT_ROWS):
            for c, bs in enumerate(kv_math.FIT_BLOCK_SIZES):
                f = table[dtypes[0]][bs]
                n = f.blocks // kv_math.request_blocks(self.shape, length, bs)
                item = self.table.item(r, c)
                _set_text(item, _count(n) if show_requests else _count(f.tokens))
                is_engine = self.engine_kv_dtype in dtypes and self.engine_block_size == bs
                tip = (f"{' / '.join(dtypes)}, block {bs}: {f.tokens:,} tokens in "
                       f"{f.blocks:,} blocks ({human_bytes(f.bytes_per_token)} per token); "
                       f"{n:,} requests of {length:,} tokens at once")
                if is_engine:
                    tip += " · the running engine's setting"
                if item.toolTip() != tip:
                    item.setToolTip(tip)
                _shade(item, is_engine)

    def _show_line(self, avail: int) -> None:
        dtype, bs = self.choice()
        length = self.request_len.value()
        n = kv_math.concurrent_requests(avail, self.shape, dtype, bs, length)
        tokens = kv_math.fit(avail, self.shape, dtype, bs).tokens
        name = dtype
        if dtype != self.dtype:  # a row of the table: all its dtypes
            name = " / ".join(next(d for _, d in FIT_ROWS if dtype in d))
        cap = ""
        if self.engine_max_seqs is not None and n > self.engine_max_seqs:
            cap = (f"; the engine runs at most {self.engine_max_seqs:,} at once "
                   f"(max sequences)")
        note = kv_math.window_note(self.shape, length)
        _set_text(self.line, f"<b>{n:,}</b> concurrent requests of {length:,} tokens at "
                             f"{name}, block {bs} ({tokens:,} tokens in all){cap}"
                             + (f"<br>{note}" if note else ""))

    def _select_default_cell(self) -> None:
        dtype, bs = self._default_cell()
        row = next((r for r, (_, d) in enumerate(FIT_ROWS) if dtype in d), -1)
        col = kv_math.FIT_BLOCK_SIZES.index(bs) if bs in kv_math.FIT_BLOCK_SIZES else -1
        if (row, col) == (self.table.currentRow(), self.table.currentColumn()):
            return
        self._setting_cell = True
        try:
            if row < 0 or col < 0:
                self.table.setCurrentItem(None)
            else:
                self.table.setCurrentCell(row, col)
        finally:
            self._setting_cell = False

    def _cell_changed(self, row: int, col: int, _prev_row: int, _prev_col: int) -> None:
        if self._setting_cell:
            return
        self._cell_chosen = row >= 0 and col >= 0
        self.recompute()

    def _manual_edited(self) -> None:
        """Typing an amount is an override: it wins over the device frames until the user
        picks "this device" again."""
        if self.source.currentText() != MANUAL:
            self.source.setCurrentText(MANUAL)  # -> recompute
        else:
            self.recompute()


def _fits_table() -> QTableWidget:
    t = QTableWidget(len(FIT_ROWS), len(kv_math.FIT_BLOCK_SIZES))
    t.setObjectName("kvFitsTable")
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
        hints = "\n".join(h for h in map(accuracy.hint, dtypes) if h)
        t.verticalHeaderItem(r).setToolTip(hints or " and ".join(dtypes))
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
    return t


def _shade(item: QTableWidgetItem, on: bool) -> None:
    """Bold on a blue background: the running engine's dtype and block size."""
    if (item.data(Qt.ItemDataRole.UserRole) or False) == on:
        return
    item.setData(Qt.ItemDataRole.UserRole, on)
    item.setBackground(QBrush(ENGINE_CELL) if on else QBrush())
    font = QFont(item.font())
    font.setBold(on)
    item.setFont(font)


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


def _set_text(widget, text: str) -> None:
    if widget.text() != text:
        widget.setText(text)
