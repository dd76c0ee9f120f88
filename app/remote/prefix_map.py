"""The prefix cache of a vLLM server (a CacheSnapshot) as a grid: one cell per cached block (by
content hash, in the order they entered the cache), coloured by chain, darker the deeper in its
chain. Cells past them, up to the pool size from /metrics, are blocks the events say nothing
about."""
from __future__ import annotations

import math

import numpy as np
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QImage, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from kvscope.app import colors

# Chains in golden-ratio hues, so neighbours in the list differ clearly.
PALETTE = np.array([QColor.fromHsvF((0.13 + 0.618034 * i) % 1.0, 0.65, 0.95).getRgb()[:3]
                    for i in range(64)], np.uint8)
UNKNOWN = np.array(colors.FREE_RGB, np.uint8)
BACKGROUND = QColor("#16181d")
MAX_CELLS = 1 << 18  # a bigger pool is drawn at its first MAX_CELLS blocks


MIN_CELLS = 64


def cell_colors(snapshot, capacity: int | None) -> np.ndarray:
    """[cells, 3] uint8: cached blocks first, then blocks the events say nothing about, up to
    the pool's size but no more than four times the cached ones (so a few cached blocks in a
    huge pool stay visible; the text gives the pool size)."""
    n = min(snapshot.num_blocks, MAX_CELLS)
    total = min(MAX_CELLS, max(n, min(capacity or 0, max(MIN_CELLS, 4 * n))))
    out = np.empty((total, 3), np.uint8)
    out[:] = UNKNOWN
    if n:
        roots = np.asarray(snapshot.roots[:n]) % len(PALETTE)
        depth = np.asarray(snapshot.depths[:n], np.float64)
        shade = 1.0 - 0.6 * np.minimum(depth, 32) / 32  # deeper in the chain: darker
        out[:n] = (PALETTE[roots] * shade[:, None]).astype(np.uint8)
    return out


def grid_columns(cells: int) -> int:
    return max(8, min(256, 2 ** round(math.log2(math.sqrt(2 * max(1, cells))))))


class PrefixMapView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMinimumSize(240, 120)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.image: QImage | None = None

    def show_cache(self, snapshot, capacity: int | None) -> None:
        rgb = cell_colors(snapshot, capacity)
        cols = grid_columns(len(rgb))
        rows = max(1, -(-len(rgb) // cols))
        grid = np.zeros((rows * cols, 3), np.uint8)
        grid[:] = (BACKGROUND.red(), BACKGROUND.green(), BACKGROUND.blue())
        grid[:len(rgb)] = rgb
        data = np.ascontiguousarray(grid.reshape(rows, cols, 3))
        self.image = QImage(data.data, cols, rows, 3 * cols, QImage.Format.Format_RGB888).copy()
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), BACKGROUND)
        if self.image is not None:
            painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, False)
            scaled = self.image.size().scaled(self.size(), Qt.AspectRatioMode.KeepAspectRatio)
            painter.drawImage(QRectF(0, 0, scaled.width(), scaled.height()), self.image)
        painter.end()


def describe_cache(c, capacity: int | None, events) -> str:
    of = f" of {capacity} in the pool" if capacity else ""
    parts = [(f"{c.num_blocks} blocks cached{of} ({c.num_tokens} tokens) in {c.num_chains} "
              f"chains, longest {c.longest_chain}"),
             f"stored {c.stored_total}, removed {c.removed_total}, cleared {c.cleared_total}×"]
    if c.unknown_removed:
        parts.append(f"{c.unknown_removed} removals of blocks stored before kvscope attached")
    if events is not None:
        parts.append(f"{events.received} batches ({events.replayed} replayed, "
                     f"{events.missed} lost, {events.bad} bad)")
    if c.mediums:
        parts.append("medium " + "/".join(c.mediums))
    return " · ".join(parts)
