"""The block map's one image item: a pyqtgraph ImageItem whose data are finished pixels.

The map applies its colour table itself (app.colors, one numpy take) and hands over 32-bit
0xffRRGGBB words, Qt's native RGB32 layout, which the painter scales without converting:
about three times cheaper per paint than the RGBA8888 image pyqtgraph would build."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QImage


def rgb32_table(lut: np.ndarray) -> np.ndarray:
    """An N x 4 RGBA uint8 colour table as N 0xffRRGGBB words (alpha is not drawn)."""
    r, g, b = (lut[:, i].astype(np.uint32) for i in range(3))
    return (0xFF << 24) | (r << 16) | (g << 8) | b


class PixelImage(pg.ImageItem):
    """setImage() takes a (rows, cols) uint32 array of RGB32 words; nothing is rescaled."""

    def __init__(self) -> None:
        super().__init__(axisOrder="row-major")
        self._pixels: np.ndarray | None = None  # the QImage's buffer: keep it alive

    def render(self) -> None:
        image = self.image
        if image is None or image.size == 0:
            self._unrenderable = True
            return
        self._pixels = np.ascontiguousarray(image, dtype=np.uint32)
        rows, cols = self._pixels.shape
        self.qimage = QImage(self._pixels.data, cols, rows, 4 * cols, QImage.Format.Format_RGB32)
        self._renderRequired = False
        self._unrenderable = False
