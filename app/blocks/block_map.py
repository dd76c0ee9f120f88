"""The KV pool as a grid: one cell per physical block, drawn as ONE pyqtgraph ImageItem.

The grid's columns follow the view's shape, so square cells fill the area for any pool size
(a 32k-block pool still gets cells of a few pixels); the wheel zooms, a drag pans, a double
click fits the whole pool again.

Each cell is an index into a colour lookup table (app.colors): owner colour (stable per
request id), brightness by fill level, distinct free / cached / shared colours, and the
blocks of a selected request kept bright while the rest is dimmed. Hover a cell for its
details; click it to select its request and see the block table (logical -> physical).

A finished request (a chat reply clicked after it ended) shows what the prefix cache still
holds of it, and a clicked cached block shows what it holds; both rest on the window's memory
of the tables it saw (app.blocks.history says what is exact and what is memory).

A preemption flashes the victim's freed blocks (app.blocks.flash); a live request's priority,
queue time and why it waits are in its selection line and its blocks' hover text.
"""
from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import colors, stale
from kvscope.app.blocks.block_grid import (
    SlotCache,
    block_indices,
    cell_pixels,
    describe_block,
    grid_image,
    grid_shape,
    request_table,
    source_note,
)
from kvscope.app.blocks.block_table import HOLDER_HEADERS, LIVE, BlockTableModel
from kvscope.app.blocks.draft_flash import with_draft_marks
from kvscope.app.blocks.flash import REASON_RGB, PreemptionFlash
from kvscope.app.blocks.history import (
    CACHED,
    EVICTED,
    FREED,
    REUSED,
    FinishedView,
    RequestHistory,
    live_holders,
)
from kvscope.app.blocks.pixel_image import PixelImage, rgb32_table
from kvscope.app.blocks.tier_strip import tier_lines
from kvscope.app.fit_label import grow_to_fit
from kvscope.app.fmt import human_bytes
from kvscope.app.request_waits import WAIT_TIPS, request_wait
from kvscope.ipc.messages import BLOCK_CACHED, BLOCK_STATE_MASK, BLOCK_USED

GRID_LINES_MIN_PX = 6  # cell borders only where a cell is this big on screen
SIDE_WIDTH = 220
# Lines the totals label holds: its longest text (a 32k-block pool, KV memory with the pool's
# byte size, requests and tokens) wraps to 11 at SIDE_WIDTH.
TOTALS_LINES = 11
TITLE = "KV block map"


class BlockMap(QWidget):
    requestSelected = Signal(str)  # "" when the selection was cleared
    blockHovered = Signal(int)  # -1 when the pointer left the grid
    blockSelected = Signal(int)  # a cached block was selected; -1 when that was cleared

    def __init__(self, parent: QWidget | None = None,
                 clock=time.monotonic) -> None:
        super().__init__(parent)
        self.frame = None
        self.flash = with_draft_marks(PreemptionFlash(clock), clock)  # issue 31
        self.selected: str | None = None
        self.selected_block = -1  # a cached block shown on its own, -1: none
        self.history = RequestHistory()
        self.hovered = -1
        self.stale: str | None = None  # why the frame on screen is old (the engine died)
        self._fitted: dict[QLabel, str] = {}  # each detail label's text when last fitted
        self.bytes_per_token: int | None = None
        self.shape = (1, 1)
        self._dirty = False
        self._flashed = False  # the image on screen has flashing cells
        self._slots = SlotCache()
        self._lut = colors.build_lut()
        pad = self._lut[colors.PAD_INDEX]
        pad[:3] = colors.MAP_BACKGROUND_RGB  # cells past the last block: the background
        self._pixels = rgb32_table(self._lut)
        self.plot = pg.PlotWidget(background=colors.hex_color(colors.MAP_BACKGROUND_RGB))
        self.plot.setObjectName("blockMapPlot")
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        vb = self.plot.getViewBox()
        vb.invertY(True)
        vb.setAspectLocked(True)
        vb.setDefaultPadding(0)
        vb.sigResized.connect(self._on_resized)
        self.image = PixelImage()
        self.plot.addItem(self.image)
        # Cell borders: one line item for the whole grid (hidden when cells get tiny).
        self.grid = pg.PlotCurveItem(pen=pg.mkPen(22, 24, 29, 255, width=1), connect="pairs")
        self.grid.setZValue(1)
        self.plot.addItem(self.grid)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.plot.scene().sigMouseClicked.connect(self._on_mouse_clicked)

        self.title = QLabel(TITLE)
        self.title.setObjectName("panelTitle")
        self.hover_label = QLabel("Hover a block for details; click one to select its request")
        self.hover_label.setObjectName("hoverLabel")
        self.hover_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.hover_label.setWordWrap(True)
        self.legend = QLabel(self._legend_html())
        self.legend.setObjectName("legend")
        self.legend.setWordWrap(True)
        self.totals = QLabel("no engine state yet")
        self.totals.setObjectName("totals")
        self.totals.setWordWrap(True)
        self.selection_label = QLabel("No request selected")
        self.selection_label.setWordWrap(True)
        self.table_model = BlockTableModel()
        self.table = QTableView()
        self.table.setModel(self.table_model)
        self.table.setObjectName("blockTable")
        self.table.verticalHeader().setVisible(False)
        # Narrow columns sized to their text, the last one takes what is left: four stretched
        # columns in the side panel's width cut both headers and states.
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Expanding)

        # Text that changes every refresh must not change its label's size: a label whose
        # size can change re-lays out the whole window on every setText (1.5-4 ms each);
        # a fixed size stops that at the label.
        for label, lines in ((self.totals, TOTALS_LINES), (self.hover_label, 4),
                             (self.selection_label, 5)):
            label.setFixedSize(SIDE_WIDTH - 12, lines * label.fontMetrics().lineSpacing() + 4)
            label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        side = QVBoxLayout()
        side.addWidget(self.legend)
        side.addWidget(self.totals)
        side.addWidget(self.hover_label)
        side.addWidget(self.selection_label)
        side.addWidget(self.table, 1)
        side_w = QWidget()
        side_w.setLayout(side)
        side_w.setFixedWidth(SIDE_WIDTH)
        # On a short screen the fixed-size labels and the table do not fit the map's height:
        # the panel scrolls vertically instead of squeezing the table to nothing.
        side_area = QScrollArea()
        side_area.setWidget(side_w)
        side_area.setWidgetResizable(True)
        side_area.setFrameShape(QScrollArea.Shape.NoFrame)
        side_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        side_area.setFixedWidth(SIDE_WIDTH + side_area.verticalScrollBar().sizeHint().width())
        side_w.setMinimumHeight(side.sizeHint().height())
        self.side_area = side_area
        left = QVBoxLayout()
        left.addWidget(self.title)
        left.addWidget(self.plot, 1)
        row = QHBoxLayout(self)
        row.setContentsMargins(4, 4, 4, 4)
        row.addLayout(left, 1)
        row.addWidget(side_area)

    # -- input ------------------------------------------------------------------------------
    def show_blocks(self, frame) -> None:
        """Keep the newest frame; the image is redrawn on the next refresh(). Every frame is
        seen by the history, which remembers the tables of requests that leave."""
        self.history.observe(frame)
        self.flash.observe(frame)
        self.frame = frame
        self._dirty = True
        if self.stale is not None:  # a new engine's first frame: live again
            self.stale = None
            self.title.setText(TITLE)

    def mark_stale(self, reason: str) -> None:
        """The engine is gone: its last pool stays in view, dimmed, and the totals say they
        are old, until a new engine's first frame."""
        self.stale = reason
        self.title.setText(f"{TITLE} {stale.NOTE}")
        self._dirty = True
        self.refresh()
        self.refresh_labels()

    def show_stats(self, stats) -> None:
        self.bytes_per_token = stats.engine.kv_bytes_per_token

    def select_request(self, request_id: str | None) -> None:
        """Highlight a request's blocks and show its block table (None: clear)."""
        request_id = request_id or None
        if request_id == self.selected and self.selected_block < 0:
            return
        had_block = self.selected_block >= 0
        self.selected, self.selected_block = request_id, -1
        self._selection_changed()
        if had_block:
            self.blockSelected.emit(-1)
        self.requestSelected.emit(request_id or "")

    def select_block(self, block: int) -> None:
        """Show one cached block on its own: what it holds and who held it."""
        if block == self.selected_block:
            return
        had_request = self.selected is not None
        self.selected, self.selected_block = None, block
        self._selection_changed()
        if had_request:
            self.requestSelected.emit("")
        self.blockSelected.emit(block)

    def _selection_changed(self) -> None:
        self._dirty = True
        self.refresh()
        self.refresh_labels()

    # -- drawing ----------------------------------------------------------------------------
    def view_pixels(self) -> tuple[float, float]:
        """The map's drawing area in pixels (0, 0 before it is laid out)."""
        rect = self.plot.getViewBox().boundingRect()
        return rect.width(), rect.height()

    def cell_pixels(self) -> float:
        """Side of one block's cell on screen, with the whole pool in view."""
        return cell_pixels(self.shape, *self.view_pixels())

    def refresh(self) -> None:
        """Redraw the image if a new frame, selection or view size arrived, or while blocks
        flash (every frame; one more redraw when the last flash has faded)."""
        if self.flash.active() or self._flashed:
            self._dirty = True
        if not self._dirty or self.frame is None:
            return
        self._dirty = False
        frame = self.frame
        shape = grid_shape(frame.num_blocks, *self.view_pixels())
        img = grid_image(block_indices(frame, self.selected, self._slots,
                                       self._highlight(frame)), shape)
        pixels = self._pixels[img]  # the colour table, applied
        if self.stale is not None:  # half as bright: the pool of an engine that is gone
            pixels = ((pixels >> 1) & 0x7F7F7F) | 0xFF000000
        self.flash.paint(pixels)
        self._flashed = bool(self.flash.blocks())
        self.image.setImage(pixels, autoLevels=False)
        if shape != self.shape:
            self.shape = shape
            self._draw_grid(shape)
            self.fit()

    def _highlight(self, frame) -> np.ndarray | None:
        """Blocks kept bright when the selection is not a live request."""
        if self.selected_block >= 0:
            return np.array([self.selected_block]) \
                if self.selected_block < frame.num_blocks else np.zeros(0, np.int64)
        if self.selected is None or self.selected in frame.request_ids:
            return None
        view = self.history.finished_view(frame, self.selected)
        return view.resident() if view is not None else np.zeros(0, np.int64)

    def fit(self) -> None:
        """The whole pool in view (after a zoom or pan)."""
        rows, cols = self.shape
        self.plot.getViewBox().setRange(xRange=(0, cols), yRange=(0, rows), padding=0)

    def _on_resized(self, *_args) -> None:
        if self.frame is None:
            return
        if grid_shape(self.frame.num_blocks, *self.view_pixels()) != self.shape:
            self._dirty = True
            self.refresh()
        else:
            self._draw_grid(self.shape)  # cell borders come and go with the cell size

    def _draw_grid(self, shape: tuple[int, int]) -> None:
        rows, cols = shape
        if cell_pixels(shape, *self.view_pixels()) < GRID_LINES_MIN_PX:
            self.grid.setData([], [])
            return
        xs, ys = [], []
        for c in range(cols + 1):
            xs += [c, c]
            ys += [0, rows]
        for r in range(rows + 1):
            xs += [0, cols]
            ys += [r, r]
        self.grid.setData(np.array(xs, float), np.array(ys, float), connect="pairs")

    def refresh_labels(self) -> None:
        """Totals, hover text and the block table (a few times a second)."""
        frame = self.frame
        if frame is None:
            return
        totals = self._totals_html(frame)
        self.totals.setText(totals if self.stale is None else stale.rich(totals, self.stale))
        if 0 <= self.hovered < frame.num_blocks:
            self.hover_label.setText(self.describe(self.hovered))
        self._show_table(frame)
        self._fit_labels(self.totals, self.hover_label, self.selection_label)

    def _fit_labels(self, *labels: QLabel) -> None:
        """A text longer than the lines its label was given grows the label (no cut line),
        and the side panel's scrolled height with it."""
        changed = [label for label in labels if self._fitted.get(label) != label.text()]
        for label in changed:  # a text seen before was fitted then: no layout to measure
            self._fitted[label] = label.text()
        if any([grow_to_fit(label) for label in changed]):
            side = self.side_area.widget()
            side.setMinimumHeight(side.layout().sizeHint().height())

    def describe(self, block: int) -> str:
        """Hover text: describe_block plus who shares it (live) or held it (remembered)."""
        frame = self.frame
        text = describe_block(frame, block)
        state = int(frame.array("flags")[block]) & BLOCK_STATE_MASK
        if state == BLOCK_USED and frame.array("ref_count")[block] > 1:
            text += " · held by " + ", ".join(r for r, _ in live_holders(frame, block)[:4])
        elif state == BLOCK_CACHED and (held := self.history.holders(frame, block)):
            text += " · last held by " + ", ".join(h.request_id for h in held[:3])
        owner = int(frame.array("owner")[block])
        if state == BLOCK_USED and 0 <= owner < len(frame.request_ids):
            text += " · " + request_wait(frame, owner).summary()
        if (p := self.flash.recent(block)) is not None:
            text += f" · just freed by preempting {p.request_id} ({p.reason}, " \
                    f"priority {p.priority})"
        return text

    def _show_table(self, frame) -> None:
        rid = self.selected
        self.selection_label.setToolTip("")
        if self.selected_block >= 0:
            self._show_block(frame, self.selected_block)
            return
        if rid is None:
            self.selection_label.setText("No request selected — click a block or a chat reply")
            self.table_model.clear()
            return
        if rid not in frame.request_ids:
            self._show_finished(frame, rid)
            return
        i = frame.request_ids.index(rid)
        table = request_table(frame, rid)
        filled = frame.array("filled")
        status = ("running" if frame.request_running[i] else "waiting") + \
            source_note(frame, rid)
        rgb = colors.hex_color(colors.request_rgb(rid))
        wait = request_wait(frame, i)
        self.selection_label.setText(
            f"<span style='color:{rgb}'>■</span> <b>{rid}</b> ({status}): "
            f"{frame.num_tokens[i]} tokens, {frame.num_computed_tokens[i]} computed, "
            f"{len(table)} blocks<br>{wait.summary()}")
        self.selection_label.setToolTip(
            "Its block table below: contiguous logically, scattered physically. Priority: "
            "lower = sooner under the priority policy. Queue time: arrival to first scheduled."
            + (f" Waiting: {WAIT_TIPS.get(wait.reason, wait.reason)}." if wait.reason else ""))
        physical = np.asarray(table, np.int64)
        at = np.where(physical < 0, 0, physical)  # -1: freed behind a sliding window
        self.table_model.show(physical, np.where(physical < 0, 0, filled[at]), frame.block_size,
                              np.full(len(physical), LIVE),
                              np.where(physical < 0, 0, frame.array("ref_count")[at]))

    def _show_finished(self, frame, rid: str) -> None:
        """A request no longer in the engine: its remembered table against today's pool."""
        view = self.history.finished_view(frame, rid)
        if view is None:
            self.selection_label.setText(
                f"<b>{rid}</b>: not in the engine, and no table of it was seen (it finished "
                "before this window saw it, or the engine restarted)")
            self.table_model.clear()
            return
        self.selection_label.setText(self._finished_html(rid, view))
        r = view.remembered
        self.selection_label.setToolTip(
            f"{rid}'s block table as this window last saw it (step {r.step}, {r.num_tokens} "
            "tokens), checked against the current pool by content tag"
            + ("" if view.exact else "; this engine sends no content tags, so an evicted "
               "block that was cached again looks still cached"))
        owner = frame.array("owner")[np.where(r.physical < 0, 0, r.physical)].astype(np.int64)
        self.table_model.show(r.physical, r.filled, frame.block_size, view.states,
                              owner=np.where(view.states == REUSED, owner, -1),
                              owner_names=frame.request_ids)

    @staticmethod
    def _finished_html(rid: str, view: FinishedView) -> str:
        r = view.remembered
        rgb = colors.hex_color(colors.request_rgb(rid))
        kept = view.count(CACHED) + view.count(REUSED)
        reused = f" ({view.count(REUSED)} reused)" if view.count(REUSED) else ""
        how = "" if view.exact else " (approximate)"
        return (f"<span style='color:{rgb}'>■</span> <b>{rid}</b> finished: "
                f"{kept} of {len(r.physical)} blocks still cached{reused}, "
                f"{view.count(EVICTED)} evicted, {view.count(FREED)} freed{how}")

    def _show_block(self, frame, block: int) -> None:
        """A cached block on its own: its content tag, fill, refs and who held it."""
        if block >= frame.num_blocks:
            self.selection_label.setText(f"block {block}: not in this pool")
            self.table_model.show_text(HOLDER_HEADERS, [])
            return
        flags = int(frame.array("flags")[block])
        state = flags & BLOCK_STATE_MASK
        tag = int(frame.block_tags()[block])
        tag_text = f"tag {tag:08x}" if tag >= 0 else "no content tag"
        rows = [(r, str(logical), "live") for r, logical in live_holders(frame, block)]
        rows += [(h.request_id, str(h.logical), "finished")
                 for h in self.history.holders(frame, block)]
        name = {BLOCK_CACHED: "cached", BLOCK_USED: "in use"}.get(state, "free")
        self.selection_label.setText(
            f"<b>block {block}</b>: {name} · {tag_text} · "
            f"ref count {int(frame.array('ref_count')[block])} · "
            f"{int(frame.array('filled')[block])}/{frame.block_size} tokens · "
            + (f"held by {len(rows)} request(s) below" if rows
               else "no request seen by this window held this content"))
        self.table_model.show_text(HOLDER_HEADERS, rows)

    def _totals_html(self, frame) -> str:
        n, bs = frame.num_blocks, frame.block_size
        per_block = self.bytes_per_token * bs if self.bytes_per_token else None
        used_slots = frame.used * bs
        waste = frame.internal_waste_slots
        waste_pct = 100 * waste / used_slots if used_slots else 0.0
        lines = [
            (f"<b>{frame.used}</b> used · <b>{frame.free}</b> free · <b>{frame.cached}</b> "
             f"cached of <b>{n}</b> blocks × {bs} tokens"),
            f"{frame.tokens_stored:,} tokens stored in {len(frame.request_ids)} requests"
            + (f" ({n_http} via HTTP)" if (n_http := len(getattr(frame, "request_sources",
                                                                   {}))) else ""),
        ]
        if per_block:
            lines.append(f"KV memory: {human_bytes(frame.used * per_block)} used of "
                         f"{human_bytes(n * per_block)}")
        lines.append(f"internal waste: {waste:,} slots ({waste_pct:.1f} % of used)"
                     + (f", {human_bytes(waste * self.bytes_per_token)}"
                        if self.bytes_per_token else ""))
        lines += tier_lines(frame)  # the host and disk tiers beside the pool (issue 56)
        if frame.reserved_max_len_blocks:
            ratio = frame.reserved_max_len_blocks / max(1, frame.used)
            lines.append(f"reserving max length: {frame.reserved_max_len_blocks:,} blocks "
                         f"({ratio:.1f}× paged); reserving prompt+max_tokens: "
                         f"{frame.reserved_request_blocks:,} blocks")
        return "<br>".join(lines)

    @staticmethod
    def _legend_html() -> str:
        def sw(rgb, text):
            return f"<span style='color:{colors.hex_color(rgb)}'>■</span> {text}"

        examples = " ".join(f"<span style='color:{colors.hex_color(colors.request_rgb(r))}'>"
                            f"■</span>" for r in ("req-1", "req-2", "req-3", "req-4"))
        return (f"{examples} owned (colour per request, brighter = fuller)<br>"
                f"{sw(colors.FREE_RGB, 'free')} &nbsp; {sw(colors.CACHED_RGB, 'cached')} "
                f"&nbsp; {sw(colors.SHARED_RGB, 'shared (ref &gt; 1)')}<br>"
                f"<span style='color:{colors.hex_color(REASON_RGB['memory'])}'>■</span>"
                f"<span style='color:{colors.hex_color(REASON_RGB['priority'])}'>■</span> "
                "flash: preempted (memory, priority)")

    def rendered_image(self):
        """The QImage the ImageItem draws, rendered from the current data (tests, export)."""
        if self.image.image is not None:
            self.image.render()
        return self.image.qimage

    # -- mouse --------------------------------------------------------------------------------
    def block_at(self, scene_pos: QPointF) -> int:
        """Block id under a scene position, -1 when none."""
        if self.frame is None:
            return -1
        p = self.image.mapFromScene(scene_pos)
        row, col = int(np.floor(p.y())), int(np.floor(p.x()))
        rows, cols = self.shape
        if not (0 <= row < rows and 0 <= col < cols):
            return -1
        block = row * cols + col
        return block if block < self.frame.num_blocks else -1

    def block_scene_pos(self, block: int) -> QPointF:
        """Centre of a block's cell in scene coordinates (tests, tooltips)."""
        cols = self.shape[1]
        return self.image.mapToScene(QPointF(block % cols + 0.5, block // cols + 0.5))

    def _on_mouse_moved(self, scene_pos) -> None:
        block = self.block_at(scene_pos)
        if block != self.hovered:
            self.hovered = block
            self.blockHovered.emit(block)
        if block >= 0:
            text = self.describe(block)
            self.hover_label.setText(text)
            self._fit_labels(self.hover_label)
            self.plot.setToolTip(text)
        else:
            self.plot.setToolTip("")

    def _on_mouse_clicked(self, event) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return
        if event.double():
            self.fit()
            return
        self.click_block(self.block_at(event.scenePos()))

    def click_block(self, block: int) -> None:
        """Select the request owning a block; a cached block is shown on its own; a free
        block clears the selection."""
        frame = self.frame
        if frame is None or block < 0:
            return
        if int(frame.array("flags")[block]) & BLOCK_STATE_MASK == BLOCK_CACHED:
            self.select_block(block)
            return
        owner = int(frame.array("owner")[block])
        rid = frame.request_ids[owner] if 0 <= owner < len(frame.request_ids) else None
        self.select_request(rid)
