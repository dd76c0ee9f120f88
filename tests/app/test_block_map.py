"""Block map: one ImageItem, pixel colours per block state/owner, hover, click-to-select."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

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


def dimmed(rgb):
    return tuple(round(c * colors.DIM_FACTOR) for c in rgb)


def running_then_finished(qtbot):
    """req-a ran with blocks 3 (full, hashed), 9 (a prefix shared with req-b) and 1 (a
    partial tail); then it finished: 3 is cached, 9 still used by req-b, 1 freed."""
    bm = make(qtbot, blocks_frame(64, 16, {"req-a": [3, 9, 1], "req-b": [9, 5]},
                                  filled={1: 4}, tags={3: 111, 9: 222}))
    bm.show_blocks(blocks_frame(64, 16, {"req-b": [9, 5]}, cached=(3,), tags={3: 111, 9: 222},
                                seq=2))
    bm.refresh()
    return bm


def test_finished_request_shows_what_the_prefix_cache_still_holds(qtbot):
    bm = running_then_finished(qtbot)
    with qtbot.waitSignal(bm.requestSelected) as sig:
        bm.select_request("req-a")  # what clicking a finished reply does
    assert sig.args == ["req-a"]
    text = bm.selection_label.text()
    assert "finished" in text and "2 of 3 blocks still cached (1 reused)" in text
    assert "1 freed" in text and "0 evicted" in text
    assert bm.table_model.rows() == [("0", "3", "16/16"), ("1", "9", "16/16"),
                                      ("2", "1", "4/16")]
    assert bm.table_model.states() == ["cached", "reused", "freed"]
    tip = bm.table.model().index(1, 3).data(Qt.ItemDataRole.ToolTipRole)
    assert "in use again by req-b" in tip
    assert "step 1" in bm.selection_label.toolTip()
    # Its blocks that still hold its KV stay bright, the rest is dimmed.
    assert rgb_at(bm, 3) == colors.CACHED_RGB
    assert rgb_at(bm, 9) == scaled(colors.request_rgb("req-b"), colors.FILL_LEVELS - 1)
    assert rgb_at(bm, 5) == dimmed(scaled(colors.request_rgb("req-b"), colors.FILL_LEVELS - 1))
    # Block 3 is evicted and refilled with other content (another tag): no longer req-a's.
    bm.show_blocks(blocks_frame(64, 16, {"req-b": [9, 5]}, cached=(3,), tags={3: 777, 9: 222},
                                seq=3))
    bm.refresh()
    bm.refresh_labels()
    assert bm.table_model.states()[0] == "evicted"
    assert "1 of 3 blocks still cached" in bm.selection_label.text()
    assert rgb_at(bm, 3) == dimmed(colors.CACHED_RGB)
    # req-b ends too and block 9 stays cached: both remembered, both see it as cached.
    bm.show_blocks(blocks_frame(64, 16, {}, cached=(3, 9), tags={3: 777, 9: 222}, seq=4))
    bm.refresh_labels()
    assert bm.table_model.states()[1] == "cached"


def test_a_restarted_engine_forgets_the_old_pool(qtbot):
    bm = running_then_finished(qtbot)
    bm.show_blocks(blocks_frame(64, 16, {}, cached=(3,), tags={3: 111}, seq=1))  # seq restarts
    bm.select_request("req-a")
    assert "no table of it was seen" in bm.selection_label.text()
    assert bm.table_model.rowCount() == 0


def test_click_on_a_cached_block_shows_what_it_holds(qtbot):
    bm = running_then_finished(qtbot)
    bm.select_request("req-b")
    with qtbot.waitSignal(bm.blockSelected) as sig:
        bm.click_block(bm.block_at(bm.block_scene_pos(3)))
    assert sig.args == [3] and bm.selected is None and bm.selected_block == 3
    text = bm.selection_label.text()
    assert "block 3" in text and "cached" in text and f"tag {111:08x}" in text
    assert "ref count 0" in text and "16/16 tokens" in text
    assert bm.table.model().headerData(0, Qt.Orientation.Horizontal) == "request"
    assert bm.table_model.rows() == [("req-a", "0", "finished")]
    assert rgb_at(bm, 3) == colors.CACHED_RGB and rgb_at(bm, 0) == dimmed(colors.FREE_RGB)
    bm._on_mouse_moved(bm.block_scene_pos(3))
    assert "last held by req-a" in bm.hover_label.text()
    # Refilled with other content: nobody the window saw held that.
    bm.show_blocks(blocks_frame(64, 16, {"req-b": [9, 5]}, cached=(3,), tags={3: 5, 9: 222},
                                seq=3))
    bm.refresh_labels()
    assert bm.table_model.rows() == [] and "no request seen" in bm.selection_label.text()
    # Clicking a used block selects its request again, with the block table back.
    with qtbot.waitSignal(bm.requestSelected) as sig:
        bm.click_block(5)
    assert sig.args == ["req-b"] and bm.selected_block == -1
    assert bm.table.model().headerData(0, Qt.Orientation.Horizontal) == "#"
    assert [physical for _, physical, _ in bm.table_model.rows()] == ["9", "5"]
    assert bm.table_model.states() == ["in use", "in use"]


def test_live_shared_block_states_its_sharers(qtbot):
    bm = make(qtbot, blocks_frame(64, 16, {"req-a": [3, 9], "req-b": [9, 5]}, tags={9: 1}))
    bm.select_request("req-a")
    assert bm.table_model.states() == ["in use", "shared ×2"]
    bm._on_mouse_moved(bm.block_scene_pos(9))
    assert "held by req-a, req-b" in bm.hover_label.text()


def test_remembering_32k_blocks_of_finishing_requests_is_cheap(qtbot):
    n = 32768
    rng = np.random.default_rng(1)
    blocks = rng.permutation(n)[:20000]
    tables = {f"r{i}": blocks[i::64].tolist() for i in range(64)}
    tags = {int(b): int(b) * 7 for b in blocks}
    frames = [blocks_frame(n, 16, tables, tags=tags, seq=1)]
    for k in range(1, 9):  # eight requests leave in every frame
        live = {r: t for i, (r, t) in enumerate(tables.items()) if i >= 8 * k}
        cached = tuple(int(b) for r, t in tables.items() if r not in live for b in t)
        frames.append(blocks_frame(n, 16, live, cached=cached, tags=tags, seq=k + 1))
    bm = make(qtbot, frames[0])
    t = time.perf_counter()
    for frame in frames[1:]:
        bm.show_blocks(frame)
    per_frame = (time.perf_counter() - t) / (len(frames) - 1)
    assert len(bm.history.finished) == 64 and per_frame < 0.05, per_frame
    bm.select_request("r0")
    assert bm.table_model.states() == ["cached"] * len(tables["r0"])


def test_the_longest_totals_text_fits_its_label_and_the_panel_scrolls(qtbot):
    """A 32k-block pool with HTTP requests, KV bytes, waste and reserves: every line of the
    totals stays inside its fixed-size label (a clipped label hid "KV memory: ... of" on a
    1280x720 screen), and a short map scrolls the side panel instead of squeezing it."""
    tables = {f"r{i}": [1000 + 3 * i, 1001 + 3 * i] for i in range(40)}
    frame = blocks_frame(32768, 16, tables, filled={1001: 6}, cached=(9, 10))
    frame.request_sources = {f"r{i}": "http" for i in range(20)}
    frame.reserved_max_len_blocks, frame.reserved_request_blocks = 123_456, 12_345
    bm = make(qtbot, frame)
    bm.bytes_per_token = 12_240
    bm.refresh_labels()
    label = bm.totals
    assert "KV memory" in label.text() and "reserving max length" in label.text()
    assert label.heightForWidth(label.width()) <= label.height()
    bm.resize(900, 300)
    qtbot.wait(20)
    area = bm.side_area
    assert area.widget().height() >= area.widget().minimumHeight()
    assert area.verticalScrollBar().maximum() > 0  # the panel scrolls
    assert area.horizontalScrollBar().maximum() == 0  # never sideways


def test_blocks_freed_behind_a_sliding_window_show_as_gone_not_as_the_last_block(qtbot):
    """A table entry of -1 (the engine freed it as every layer's window moved past it) is no
    block: the last block of the pool is not marked as the request's, and the table says the
    entry left behind the window, live and after the request finished."""
    frame = blocks_frame(64, 16, {"req-a": [-1, -1, 7, 8], "req-b": [63]}, filled={8: 5})
    bm = make(qtbot, frame)
    bm.select_request("req-a")
    bm.refresh()
    bm.refresh_labels()
    assert bm.table_model.rows() == [("0", "—", "0/16"), ("1", "—", "0/16"),
                                      ("2", "7", "16/16"), ("3", "8", "5/16")]
    assert bm.table_model.states()[:2] == ["freed (window)"] * 2
    assert bm.table_model.states()[2:] == ["in use", "in use"]
    top = colors.FILL_LEVELS - 1
    assert rgb_at(bm, 63) == dimmed(scaled(colors.request_rgb("req-b"), top))
    bm.show_blocks(blocks_frame(64, 16, {"req-b": [63]}, seq=2))
    bm.refresh_labels()
    assert bm.table_model.states() == ["freed (window)", "freed (window)", "freed", "freed"]
