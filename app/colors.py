"""Colours of the block map: a stable colour per request id, plus free/cached/shared.

The block map draws one ImageItem whose pixels are indices into one lookup table (LUT):
index = (slot * FILL_LEVELS + fill_level) + (DIM_OFFSET if dimmed). A slot is either a
request colour or one of the special states below. Requests take the palette's colours in
the order they are first seen (every view asks this module, so chat and map agree), so any
16 consecutive requests have 16 different colours; the palette was chosen for its measured
difference (CIEDE2000, app.color_difference): tests/app/test_colors.py holds it to that.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

FILL_LEVELS = 8  # brightness steps for filled / block_size
# Greedy max-min ΔE00 over an HSV grid: pairwise >= 15 at full brightness, and >= 22 from
# free, cached and the map's background at every fill level; neighbours differ most.
PALETTE = (
    (0, 255, 0), (179, 0, 255), (255, 128, 0), (255, 166, 193), (191, 19, 54),
    (48, 191, 177), (255, 217, 64), (255, 0, 153), (164, 191, 124), (221, 140, 255),
    (255, 117, 102), (191, 77, 0), (191, 157, 105), (140, 255, 198), (232, 255, 140),
    (0, 191, 115),
)
NUM_REQUEST_COLORS = len(PALETTE)
REMEMBERED_REQUESTS = 4096  # ids older than this many get a colour anew if seen again
SLOT_FREE, SLOT_CACHED, SLOT_SHARED, SLOT_UNKNOWN = range(4)
FIRST_REQUEST_SLOT = 4
NUM_SLOTS = FIRST_REQUEST_SLOT + NUM_REQUEST_COLORS
DIM_OFFSET = NUM_SLOTS * FILL_LEVELS  # second half of the LUT: the same colours, dimmed
PAD_INDEX = 2 * DIM_OFFSET  # grid cells past the last block: transparent
LUT_SIZE = PAD_INDEX + 1

MAP_BACKGROUND_RGB = (22, 24, 29)
FREE_RGB = (38, 41, 48)
CACHED_RGB = (70, 110, 150)
SHARED_RGB = (245, 245, 245)
UNKNOWN_RGB = (128, 128, 128)
SPECIAL_RGB = {SLOT_FREE: FREE_RGB, SLOT_CACHED: CACHED_RGB, SLOT_SHARED: SHARED_RGB,
               SLOT_UNKNOWN: UNKNOWN_RGB}
# An allocated but empty block is still visibly its owner's colour, and never near free grey.
MIN_BRIGHTNESS = 0.5
DIM_FACTOR = 0.25


class ColorBook:
    """request id -> palette index, round robin in the order ids are first seen."""

    def __init__(self) -> None:
        self._index: OrderedDict[str, int] = OrderedDict()
        self._next = 0

    def index(self, request_id: str) -> int:
        i = self._index.get(request_id)
        if i is None:
            i = self._index[request_id] = self._next
            self._next = (self._next + 1) % NUM_REQUEST_COLORS
            if len(self._index) > REMEMBERED_REQUESTS:
                self._index.popitem(last=False)
        return i


_BOOK = ColorBook()  # one for the whole window: the chat and the map show the same colour


def request_slot(request_id: str) -> int:
    """The colour slot of a request: the same id keeps its colour."""
    return FIRST_REQUEST_SLOT + _BOOK.index(request_id)


def request_rgb(request_id: str) -> tuple[int, int, int]:
    return _slot_rgb(request_slot(request_id))


def _slot_rgb(slot: int) -> tuple[int, int, int]:
    if slot in SPECIAL_RGB:
        return SPECIAL_RGB[slot]
    return PALETTE[slot - FIRST_REQUEST_SLOT]


def brightness(level: int) -> float:
    return MIN_BRIGHTNESS + (1 - MIN_BRIGHTNESS) * level / (FILL_LEVELS - 1)


def build_lut() -> np.ndarray:
    """LUT_SIZE x 4 uint8 RGBA."""
    lut = np.zeros((LUT_SIZE, 4), np.uint8)
    for slot in range(NUM_SLOTS):
        base = np.array(_slot_rgb(slot), np.float64)
        for level in range(FILL_LEVELS):
            # Special states keep one colour; requests get brighter as their block fills.
            scale = 1.0 if slot in SPECIAL_RGB else brightness(level)
            rgb = np.clip(np.round(base * scale), 0, 255)
            i = slot * FILL_LEVELS + level
            lut[i, :3] = rgb
            lut[i + DIM_OFFSET, :3] = np.round(rgb * DIM_FACTOR)
    lut[:, 3] = 255
    lut[PAD_INDEX] = 0
    return lut


def fill_level(filled: np.ndarray, block_size: int) -> np.ndarray:
    """0 .. FILL_LEVELS-1: empty blocks 0, full blocks the top level."""
    bs = max(1, block_size)
    # ceil(filled / bs * (FILL_LEVELS - 1)) in integers (a float pass costs ~1 ms at 32k)
    level = (np.asarray(filled, np.int32) * (FILL_LEVELS - 1) + bs - 1) // bs
    return np.clip(level, 0, FILL_LEVELS - 1)


def hex_color(rgb: tuple[int, int, int]) -> str:
    r, g, b = rgb
    return f"#{r:02x}{g:02x}{b:02x}"
