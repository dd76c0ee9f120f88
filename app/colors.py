"""Colours of the block map: a stable colour per request id, plus free/cached/shared.

The block map draws one ImageItem whose pixels are indices into one lookup table (LUT):
index = (slot * FILL_LEVELS + fill_level) + (DIM_OFFSET if dimmed). A slot is either a
request colour (picked from the request id, so it never changes between frames) or one of
the special states below.
"""
from __future__ import annotations

import colorsys
import zlib

import numpy as np

FILL_LEVELS = 8  # brightness steps for filled / block_size
NUM_REQUEST_COLORS = 40
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
MIN_BRIGHTNESS = 0.35  # an allocated but empty block is still visibly its owner's colour
DIM_FACTOR = 0.25


def request_slot(request_id: str) -> int:
    """The colour slot of a request: the same id always gets the same colour."""
    return FIRST_REQUEST_SLOT + zlib.crc32(request_id.encode()) % NUM_REQUEST_COLORS


def request_rgb(request_id: str) -> tuple[int, int, int]:
    return _slot_rgb(request_slot(request_id))


def _slot_rgb(slot: int) -> tuple[int, int, int]:
    if slot in SPECIAL_RGB:
        return SPECIAL_RGB[slot]
    i = slot - FIRST_REQUEST_SLOT
    hue = (i * 0.618033988749895) % 1.0  # golden-ratio steps: neighbours differ a lot
    sat = 0.55 + 0.35 * ((i * 7) % 3) / 2
    r, g, b = colorsys.hsv_to_rgb(hue, sat, 1.0)
    return round(r * 255), round(g * 255), round(b * 255)


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
