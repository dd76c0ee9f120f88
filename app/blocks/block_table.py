"""The selected request's block table (logical -> physical, fill) as a Qt model over numpy
arrays: a new frame swaps the arrays and the view asks only for the rows it shows, so a
request with thousands of blocks costs no more per frame than one with ten."""
from __future__ import annotations

import numpy as np
from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt

HEADERS = ("logical", "physical", "filled")


class BlockTableModel(QAbstractTableModel):
    def __init__(self) -> None:
        super().__init__()
        self.physical = np.zeros(0, np.int64)
        self.filled = np.zeros(0, np.int64)
        self.block_size = 0

    def show(self, physical, filled, block_size: int) -> None:
        """The request's physical blocks in logical order, and how full each one is. Only
        the rows that changed are repainted (usually one: the block being filled)."""
        physical = np.asarray(physical, np.int64)
        filled = np.asarray(filled, np.int64)
        if len(physical) != len(self.physical) or block_size != self.block_size:
            self.beginResetModel()
            self.physical, self.filled, self.block_size = physical, filled, block_size
            self.endResetModel()
            return
        changed = np.flatnonzero((physical != self.physical) | (filled != self.filled))
        self.physical, self.filled = physical, filled
        if len(changed):
            self.dataChanged.emit(self.index(int(changed[0]), 0),
                                  self.index(int(changed[-1]), len(HEADERS) - 1))

    def clear(self) -> None:
        self.show([], [], 0)

    def text(self, row: int, col: int) -> str:
        if col == 0:
            return str(row)
        if col == 1:
            return str(int(self.physical[row]))
        return f"{int(self.filled[row])}/{self.block_size}"

    def rows(self) -> list[tuple[str, str, str]]:
        """Every row as the view shows it (tests, copying)."""
        return [tuple(self.text(r, c) for c in range(len(HEADERS)))
                for r in range(len(self.physical))]

    # -- QAbstractTableModel --------------------------------------------------------------------
    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008 - Qt's own signature
        return 0 if parent.isValid() else len(self.physical)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(HEADERS)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and index.isValid():
            return self.text(index.row(), index.column())
        return None

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return HEADERS[section]
        return None
