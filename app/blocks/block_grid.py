"""Pure numpy: a BlocksFrame -> LUT indices on a grid (one cell per physical block)."""
from __future__ import annotations

import math

import numpy as np

from kvscope.app import colors
from kvscope.ipc.messages import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_HAS_HASH,
    BLOCK_STATE_MASK,
    BLOCK_USED,
)

STATE_NAMES = {BLOCK_FREE: "free", BLOCK_CACHED: "cached (free, reusable prefix)",
               BLOCK_USED: "in use"}


def grid_shape(num_blocks: int, width: float = 0, height: float = 0) -> tuple[int, int]:
    """(rows, cols) of square cells that fill a width x height view (pixels) as fully as
    num_blocks cells can: the column count with the largest cell, fewest empty cells on a
    tie. An unknown size (0) means a view twice as wide as tall."""
    if num_blocks <= 0:
        return 1, 1
    if not (width > 0 and height > 0):
        width, height = 2.0, 1.0
    guess = math.sqrt(num_blocks * width / height)
    best = None
    for cols in range(max(1, math.floor(guess) - 2), math.ceil(guess) + 3):
        cols = min(cols, num_blocks)
        rows = -(-num_blocks // cols)
        cell = min(width / cols, height / rows)
        key = (cell, -(rows * cols))
        if best is None or key > best[0]:
            best = (key, (rows, cols))
    return best[1]


def cell_pixels(shape: tuple[int, int], width: float, height: float) -> float:
    """Side of one square cell when the grid fills a width x height view."""
    rows, cols = shape
    return min(width / cols, height / rows)


class SlotCache:
    """request id -> colour slot, memoised (crc32 per id per frame adds up at 64 requests)."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}

    def slots(self, request_ids: list[str]) -> np.ndarray:
        out = np.empty(len(request_ids), np.int64)
        for i, rid in enumerate(request_ids):
            s = self._slots.get(rid)
            if s is None:
                if len(self._slots) > 100_000:
                    self._slots.clear()
                s = self._slots[rid] = colors.request_slot(rid)
            out[i] = s
        return out


def block_indices(frame, selected: str | None = None,
                  cache: SlotCache | None = None,
                  highlight: np.ndarray | None = None) -> np.ndarray:
    """One LUT index per block (uint16), see app.colors. Whole-array numpy only: at 32k
    blocks this runs every frame. highlight: block ids kept bright (the rest dimmed) when
    no live request is selected: a finished request's cached blocks, a selected block."""
    state = frame.array("flags") & BLOCK_STATE_MASK
    owner = frame.array("owner")
    num_requests = len(frame.request_ids)
    # A slot per owner index, and one past the end for "no known owner".
    owner_slots = np.full(num_requests + 1, colors.SLOT_UNKNOWN, np.int32)
    if num_requests:
        owner_slots[:num_requests] = (cache or SlotCache()).slots(frame.request_ids)
    known = np.where((owner >= 0) & (owner < num_requests), owner, num_requests)
    used_slot = np.where(frame.array("ref_count") > 1, colors.SLOT_SHARED, owner_slots[known])
    slot = np.where(state == BLOCK_USED, used_slot, _STATE_SLOTS[state])
    idx = slot * colors.FILL_LEVELS + colors.fill_level(frame.array("filled"), frame.block_size)
    if selected is not None and selected in frame.request_ids:
        mine = np.zeros(frame.num_blocks, bool)
        i = frame.request_ids.index(selected)
        offsets = frame.array("table_offsets")
        table = frame.array("tables")[offsets[i]:offsets[i + 1]]
        mine[table[table >= 0]] = True  # -1: freed behind a sliding window
        idx[~mine] += colors.DIM_OFFSET
    elif highlight is not None:
        mine = np.zeros(frame.num_blocks, bool)
        mine[highlight] = True
        idx[~mine] += colors.DIM_OFFSET
    return idx.astype(np.uint16)


# The slot of a block that is not in use, by its state bits (anything unknown: SLOT_UNKNOWN).
_STATE_SLOTS = np.full(BLOCK_STATE_MASK + 1, colors.SLOT_UNKNOWN, np.int32)
_STATE_SLOTS[BLOCK_FREE] = colors.SLOT_FREE
_STATE_SLOTS[BLOCK_CACHED] = colors.SLOT_CACHED


def grid_image(indices: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    img = np.full(rows * cols, colors.PAD_INDEX, np.uint16)
    img[:len(indices)] = indices
    return img.reshape(rows, cols)


def request_table(frame, request_id: str) -> list[int]:
    try:
        return frame.block_table(request_id)
    except ValueError:
        return []


def source_note(frame, rid: str) -> str:
    """" via HTTP" for a request the engine's OpenAI API took, "" for the window's own."""
    source = getattr(frame, "request_sources", {}).get(rid)
    return f" via {source.upper()}" if source else ""


def describe_block(frame, block: int) -> str:
    """Hover text: block id, state, owner, tokens filled, ref count."""
    flags = int(frame.array("flags")[block])
    state = flags & BLOCK_STATE_MASK
    filled = int(frame.array("filled")[block])
    ref = int(frame.array("ref_count")[block])
    parts = [f"block {block}", STATE_NAMES.get(state, "?")]
    owner = int(frame.array("owner")[block])
    if state == BLOCK_USED and 0 <= owner < len(frame.request_ids):
        rid = frame.request_ids[owner]
        table = request_table(frame, rid)
        logical = table.index(block) if block in table else None
        where = f" (logical block {logical})" if logical is not None else ""
        parts.append(f"owner {rid}{where}{source_note(frame, rid)}")
    elif state == BLOCK_USED:
        parts.append("owner: none")
    parts.append(f"{filled}/{frame.block_size} tokens filled")
    parts.append(f"ref count {ref}" + (" (shared)" if ref > 1 else ""))
    if flags & BLOCK_HAS_HASH:
        parts.append("prefix-cached")
    return " · ".join(parts)
