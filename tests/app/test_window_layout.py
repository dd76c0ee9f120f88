"""The default layout at common screen sizes: the KV block map is the largest view, its cells
fill its area for any pool size, and a 32k-block pool still shows every block."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QSettings

from kvscope.app.main import STYLE
from kvscope.app.main_window import MainWindow, shown
from kvscope.testing.frames import blocks_frame

SIZES = [(1366, 768), (1600, 900), (1920, 1080)]


@pytest.fixture
def window_at(qtbot, qapp, tmp_path):
    qapp.setStyleSheet(STYLE.read_text())  # the real fonts and margins, as `kvscope` runs
    made = []

    def make(width: int, height: int) -> MainWindow:
        settings = QSettings(str(tmp_path / f"{width}.ini"), QSettings.Format.IniFormat)
        w = MainWindow(attach="tcp://127.0.0.1:9", settings=settings)
        qtbot.addWidget(w)
        w.resize(width, height)
        w.show()
        qtbot.waitExposed(w)
        qapp.processEvents()
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()
    qapp.setStyleSheet("")


def area(widget) -> int:
    return widget.width() * widget.height()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_block_map_is_the_largest_view(window_at, size):
    w = window_at(*size)
    assert (w.width(), w.height()) == size
    the_map = w.block_map.plot  # the drawing area alone, not its legend or block table
    others = {"chat": w.chat, "batch plots": w.plots, "device panel": w.device_panel,
              "controls": w.side_dock}
    visible = {name: view for name, view in others.items() if shown(view)}
    assert "chat" in visible and "batch plots" in visible and "device panel" in visible
    assert shown(the_map)
    for name, view in visible.items():
        assert area(the_map) > area(view), (
            f"at {size}: the map {the_map.width()}x{the_map.height()} is smaller than the "
            f"{name} {view.width()}x{view.height()}")


@pytest.mark.parametrize("size", [SIZES[0], SIZES[2]], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("blocks", [364, 32768])
def test_cells_fill_the_map(window_at, size, blocks):
    w = window_at(*size)
    bm = w.block_map
    bm.show_blocks(blocks_frame(blocks, 16, {"a": [0, 1, 2]}))
    bm.refresh()
    width, height = bm.view_pixels()
    rows, cols = bm.shape
    assert rows * cols >= blocks > (rows - 1) * cols  # one cell per block, no empty row
    cell = bm.cell_pixels()
    assert cell >= 1  # every block is at least a pixel, without zooming
    # Square cells cover most of the area whatever the pool size (the old fixed grid left
    # 364 blocks under a third of it).
    assert blocks * cell * cell > 0.6 * width * height
    if blocks == 364:
        assert cell >= 15  # a small pool gets big cells


def test_controls_get_their_own_column_on_a_wide_window(window_at):
    wide = window_at(1920, 1080)
    assert shown(wide.side_dock) and shown(wide.chat)
    narrow = window_at(1366, 768)
    assert shown(narrow.chat) and not shown(narrow.side_dock)  # a tab behind the chat
    assert narrow.tabifiedDockWidgets(narrow.chat_dock) == [narrow.side_dock]
