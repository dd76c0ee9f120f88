"""Blocks with rolled-back draft slots flash on the block map, then fade (issue 31)."""
from __future__ import annotations

import numpy as np

from kvscope.app.blocks.draft_flash import DRAFT_RGB, with_draft_marks
from kvscope.app.blocks.flash import FLASH_S, PreemptionFlash
from kvscope.ipc.messages import PreemptionEvent


class Frame:
    num_blocks = 8

    def __init__(self, rolled=(), preempted=()):
        self.rolled_back_blocks = list(rolled)
        self.preemptions = [PreemptionEvent("r", "memory", list(preempted), 0, 1)] \
            if preempted else []


def test_rolled_back_blocks_flash_and_fade():
    now = [0.0]
    flash = with_draft_marks(PreemptionFlash(lambda: now[0]), lambda: now[0])
    assert flash.observe(Frame(rolled=[2, 5], preempted=[5]))
    pixels = np.full((2, 4), 0xFF000000, np.uint32)
    flash.paint(pixels)
    r, g, b = DRAFT_RGB
    assert pixels.reshape(-1)[2] == 0xFF000000 | r << 16 | g << 8 | b
    assert pixels.reshape(-1)[5] != pixels.reshape(-1)[2]  # the preemption's colour wins
    assert flash.blocks() == [2, 5]
    now[0] = FLASH_S + 0.01
    assert not flash.active()
