"""The selected request's block table (logical -> physical, fill, state) as a Qt model over
numpy arrays: a new frame swaps the arrays and the view asks only for the rows it shows, so a
request with thousands of blocks costs no more per frame than one with ten. It can also show
a few rows of plain text instead (a selected block's holders)."""
from __future__ import annotations

import numpy as np
from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt

from kvscope.app.blocks.history import BEHIND_WINDOW, CACHED, EVICTED, FREED, REUSED

# Narrow headers: the map's side panel is about 200 px wide; the tooltips spell them out.
HEADERS = ("#", "block", "filled", "state")
HOLDER_HEADERS = ("request", "#", "state")
HEADER_TIPS = {"#": "logical block index in the request (token position / block size)",
               "block": "physical block id in the KV pool", "filled": "tokens written",
               "state": "what the block is now", "request": "a request that held the block"}
LIVE = 0  # a live request's block; the finished ones' states come from history
# Short enough for the map's narrow side panel; the tooltip says it in full.
STATE_TEXT = {CACHED: "cached", REUSED: "reused", EVICTED: "evicted", FREED: "freed",
              BEHIND_WINDOW: "freed (window)"}
STATE_TIPS = {
    CACHED: "still in the prefix cache with this request's content (free, reusable)",
    EVICTED: "taken for other content since: this request's KV is gone from it",
    BEHIND_WINDOW: "freed while the request ran: every layer's sliding window had moved past "
                   "it, so no query can attend to it again",
    FREED: "had no content hash when last seen (a partial block or a private copy), so it "
           "was freed, not cached, when the request ended"}


class BlockTableModel(QAbstractTableModel):
    def __init__(self) -> None:
        super().__init__()
        self.physical = np.zeros(0, np.int64)
        self.filled = np.zeros(0, np.int64)
        self.state = np.zeros(0, np.int64)
        self.ref = np.zeros(0, np.int64)
        self.owner = np.zeros(0, np.int64)
        self.owner_names: list[str] = []
        self.block_size = 0
        self.headers = HEADERS
        self.text_rows: list[tuple[str, ...]] | None = None  # holder rows instead of arrays

    def show(self, physical, filled, block_size: int, state=None, ref=None, owner=None,
             owner_names: list[str] | None = None) -> None:
        """A request's physical blocks in logical order, how full each one is, and what each
        is (state: LIVE or a history state; ref: holders of a live block; owner: index into
        owner_names of a reused block's live owner). Only the rows that changed are
        repainted (usually one: the block being filled)."""
        physical = np.asarray(physical, np.int64)
        zeros = np.zeros(len(physical), np.int64)
        filled = np.asarray(filled, np.int64)
        state = zeros if state is None else np.asarray(state, np.int64)
        ref = zeros if ref is None else np.asarray(ref, np.int64)
        owner = zeros - 1 if owner is None else np.asarray(owner, np.int64)
        self.owner_names = list(owner_names or [])
        if self.text_rows is not None or len(physical) != len(self.physical) or \
                block_size != self.block_size:
            self.beginResetModel()
            self.text_rows, self.headers = None, HEADERS
            self.physical, self.filled, self.block_size = physical, filled, block_size
            self.state, self.ref, self.owner = state, ref, owner
            self.endResetModel()
            return
        changed = np.flatnonzero((physical != self.physical) | (filled != self.filled)
                                 | (state != self.state) | (ref != self.ref)
                                 | (owner != self.owner))
        self.physical, self.filled = physical, filled
        self.state, self.ref, self.owner = state, ref, owner
        if len(changed):
            self.dataChanged.emit(self.index(int(changed[0]), 0),
                                  self.index(int(changed[-1]), len(HEADERS) - 1))

    def show_text(self, headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        """A few rows of text (a selected block's holders), replacing the table."""
        if rows == self.text_rows and headers == self.headers:
            return
        self.beginResetModel()
        self.headers, self.text_rows = headers, list(rows)
        self.endResetModel()
        self.headerDataChanged.emit(Qt.Orientation.Horizontal, 0, len(headers) - 1)

    def clear(self) -> None:
        self.show([], [], 0)

    def text(self, row: int, col: int) -> str:
        if self.text_rows is not None:
            return self.text_rows[row][col]
        if col == 0:
            return str(row)
        if col == 1:
            block = int(self.physical[row])
            return "—" if block < 0 else str(block)
        if col == 2:
            return f"{int(self.filled[row])}/{self.block_size}"
        return self.state_text(row)

    def state_text(self, row: int) -> str:
        state = int(self.state[row])
        if self.physical[row] < 0:
            state = BEHIND_WINDOW
        if state == LIVE:
            ref = int(self.ref[row])
            return f"shared ×{ref}" if ref > 1 else "in use"
        return STATE_TEXT.get(state, "?")

    def tooltip(self, row: int) -> str:
        if self.text_rows is not None:
            return " · ".join(self.text_rows[row])
        state = int(self.state[row])
        if self.physical[row] < 0:
            state = BEHIND_WINDOW
        if state == LIVE:
            ref = int(self.ref[row])
            return f"in {ref} requests' block tables (a shared prefix)" if ref > 1 else \
                "in this request's block table only"
        if state == REUSED:
            owner = int(self.owner[row])
            name = self.owner_names[owner] if 0 <= owner < len(self.owner_names) else None
            return "still cached with this request's content and in use again by " + \
                (name or "a live request") + " (a prefix-cache hit)"
        return STATE_TIPS.get(state, "")

    def rows(self) -> list[tuple[str, ...]]:
        """Every row's logical, physical and filled text as the view shows them (tests,
        copying); a text table's rows whole."""
        if self.text_rows is not None:
            return list(self.text_rows)
        return [tuple(self.text(r, c) for c in range(3)) for r in range(len(self.physical))]

    def states(self) -> list[str]:
        """The state column, row by row."""
        return [self.text(r, len(self.headers) - 1) for r in range(self.rowCount())]

    # -- QAbstractTableModel --------------------------------------------------------------------
    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008 - Qt's own signature
        if parent.isValid():
            return 0
        return len(self.text_rows) if self.text_rows is not None else len(self.physical)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.headers)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self.text(index.row(), index.column())
        if role == Qt.ItemDataRole.ToolTipRole:
            return self.tooltip(index.row())
        return None

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation != Qt.Orientation.Horizontal or not 0 <= section < len(self.headers):
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self.headers[section]
        if role == Qt.ItemDataRole.ToolTipRole:
            return HEADER_TIPS.get(self.headers[section])
        return None
