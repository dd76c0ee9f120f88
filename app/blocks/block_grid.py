"""Pure numpy: a BlocksFrame -> LUT indices on a grid (one cell per physical block)."""
from __future__ import annotations

import math

import numpy as np

from app import colors
from ipc.messages import BLOCK_CACHED, BLOCK_FREE, BLOCK_HAS_HASH, BLOCK_STATE_MASK, BLOCK_USED

STATE_NAMES = {BLOCK_FREE: "free", BLOCK_CACHED: "cached (free, reusable prefix)",
               BLOCK_USED: "in use"}


def grid_shape(num_blocks: int) -> tuple[int, int]:
    """(rows, cols): power-of-two columns, about twice as wide as tall, 8..256 columns."""
    if num_blocks <= 0:
        return 1, 1
    cols = 2 ** math.floor(math.log2(math.sqrt(2 * num_blocks)) + 0.5)
    cols = max(8, min(256, cols))
    return -(-num_blocks // cols), cols


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
                  cache: SlotCache | None = None) -> np.ndarray:
    """One LUT index per block (uint16), see app.colors."""
    n = frame.num_blocks
    state = frame.array("flags") & BLOCK_STATE_MASK
    owner = frame.array("owner")
    ref = frame.array("ref_count")
    slot = np.full(n, colors.SLOT_UNKNOWN, np.int64)
    slot[state == BLOCK_FREE] = colors.SLOT_FREE
    slot[state == BLOCK_CACHED] = colors.SLOT_CACHED
    used = state == BLOCK_USED
    owned = used & (owner >= 0) & (owner < len(frame.request_ids))
    if owned.any():
        req_slots = (cache or SlotCache()).slots(frame.request_ids)
        slot[owned] = req_slots[owner[owned]]
    slot[used & (ref > 1)] = colors.SLOT_SHARED
    idx = slot * colors.FILL_LEVELS + colors.fill_level(frame.array("filled"), frame.block_size)
    if selected is not None and selected in frame.request_ids:
        mine = np.zeros(n, bool)
        table = request_table(frame, selected)
        if table:
            mine[np.asarray(table, np.int64)] = True
        idx[~mine] += colors.DIM_OFFSET
    return idx.astype(np.uint16)


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
        parts.append(f"owner {rid}{where}")
    elif state == BLOCK_USED:
        parts.append("owner: none")
    parts.append(f"{filled}/{frame.block_size} tokens filled")
    parts.append(f"ref count {ref}" + (" (shared)" if ref > 1 else ""))
    if flags & BLOCK_HAS_HASH:
        parts.append("prefix-cached")
    return " · ".join(parts)
