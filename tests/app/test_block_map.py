"""Block map: one ImageItem, pixel colours per block state/owner, hover, click-to-select."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import time

import numpy as np
import pyqtgraph as pg

from kvscope.app import colors
from kvscope.app.blocks.block_grid import grid_shape
from kvscope.app.blocks.block_map import BlockMap
from kvscope.testing.frames import blocks_frame


def make(qtbot, frame):
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.resize(900, 500)
    bm.show()
    bm.show_blocks(frame)
    bm.refresh()
    bm.refresh_labels()
    return bm


def rgb_at(bm, block):
    cols = bm.shape[1]
    return bm.rendered_image().pixelColor(block % cols, block // cols).getRgb()[:3]


def scaled(rgb, level):
    return tuple(round(c * colors.brightness(level)) for c in rgb)


def test_pixels_show_owner_fill_free_cached_shared(qtbot):
    frame = blocks_frame(64, 16, {"req-a": [3, 9, 1], "req-b": [5, 9]}, filled={1: 4},
                         cached=(20,))
    bm = make(qtbot, frame)
    images = [i for i in bm.plot.getPlotItem().items if isinstance(i, pg.ImageItem)]
    assert images == [bm.image]  # one item for the whole pool
    assert bm.image.image.shape[:2] == grid_shape(64, *bm.view_pixels())
    top = colors.FILL_LEVELS - 1
    assert rgb_at(bm, 3) == scaled(colors.request_rgb("req-a"), top)  # full block
    assert rgb_at(bm, 5) == scaled(colors.request_rgb("req-b"), top)
    partial = rgb_at(bm, 1)  # 4/16 filled: same hue, darker
    assert partial == scaled(colors.request_rgb("req-a"), 2)
    assert sum(partial) < sum(rgb_at(bm, 3))
    assert rgb_at(bm, 9) == colors.SHARED_RGB  # in two block tables
    assert rgb_at(bm, 0) == colors.FREE_RGB
    assert rgb_at(bm, 20) == colors.CACHED_RGB
    assert len({rgb_at(bm, b) for b in (3, 5, 9, 0, 20)}) == 5


def test_request_colours_are_stable_across_frames(qtbot):
    bm = make(qtbot, blocks_frame(64, 16, {"x": [1], "y": [2]}))
    before = rgb_at(bm, 2)
    # y is now first in request_ids and owns another block: its colour does not move.
    bm.show_blocks(blocks_frame(64, 16, {"y": [2, 7], "z": [4]}, seq=2))
    bm.refresh()
    assert rgb_at(bm, 2) == before == rgb_at(bm, 7)


def test_hover_describes_block(qtbot):
    frame = blocks_frame(64, 16, {"req-a": [3, 9, 1], "req-b": [5, 9]}, filled={1: 4})
    bm = make(qtbot, frame)
    bm._on_mouse_moved(bm.block_scene_pos(1))
    text = bm.hover_label.text()
    assert "block 1" in text and "owner req-a" in text and "logical block 2" in text
    assert "4/16 tokens" in text and "ref count 1" in text
    bm._on_mouse_moved(bm.block_scene_pos(9))
    assert "ref count 2 (shared)" in bm.hover_label.text()
    assert bm.hovered == 9


def test_click_selects_request_and_shows_block_table(qtbot):
    frame = blocks_frame(64, 16, {"req-a": [30, 2, 17], "req-b": [5]})
    bm = make(qtbot, frame)
    with qtbot.waitSignal(bm.requestSelected) as sig:
        bm.click_block(bm.block_at(bm.block_scene_pos(17)))
    assert sig.args == ["req-a"]
    bm.refresh_labels()
    rows = bm.table_model.rows()
    assert rows == [("0", "30", "16/16"), ("1", "2", "16/16"), ("2", "17", "16/16")]
    view = bm.table.model()  # what the view shows: the same rows
    assert view.rowCount() == 3 and view.index(2, 1).data() == "17"
    # A fuller block in the next frame shows up in the same rows.
    bm.show_blocks(blocks_frame(64, 16, {"req-a": [30, 2, 17, 40], "req-b": [5]},
                                filled={40: 3}, seq=2))
    bm.refresh_labels()
    assert bm.table_model.rows()[-1] == ("3", "40", "3/16")
    assert "req-a" in bm.selection_label.text()
    # Its blocks stay bright, the others are dimmed.
    top = colors.FILL_LEVELS - 1
    assert rgb_at(bm, 2) == scaled(colors.request_rgb("req-a"), top)
    other = scaled(colors.request_rgb("req-b"), top)
    assert rgb_at(bm, 5) == tuple(round(c * colors.DIM_FACTOR) for c in other)
    bm.click_block(0)  # a free block clears the selection
    bm.refresh_labels()
    assert bm.selected is None and bm.table.model().rowCount() == 0


def test_totals_show_used_free_cached_waste_and_reserve(qtbot):
    bm = make(qtbot, blocks_frame(64, 16, {"a": [1, 2]}, filled={2: 6}, cached=(9, 10)))
    text = bm.totals.text()
    assert "<b>2</b> used" in text and "<b>60</b> free" in text and "<b>2</b> cached" in text
    assert "internal waste: 10 slots" in text
    assert "reserving max length: 32 blocks" in text


def test_32k_blocks_redraw_fast(qtbot):
    n = 32768
    rng = np.random.default_rng(0)
    blocks = rng.permutation(n)[:20000]
    tables = {f"r{i}": blocks[i::64].tolist() for i in range(64)}
    frame = blocks_frame(n, 16, tables)
    bm = make(qtbot, frame)
    rows, cols = bm.image.image.shape[:2]
    assert rows * cols >= n > (rows - 1) * cols  # one cell per block, no empty row
    assert bm.cell_pixels() >= 1  # every block visible without zooming
    t = time.perf_counter()
    for _ in range(10):
        bm.show_blocks(frame)
        bm.refresh()
    per_frame = (time.perf_counter() - t) / 10
    assert per_frame < 0.1, per_frame
