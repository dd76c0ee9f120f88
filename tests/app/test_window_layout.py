"""The default layout at common screen sizes: the KV block map is the largest view, its cells
fill its area for any pool size, and a 32k-block pool still shows every block."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QRect, QSettings

from kvscope.app.main import STYLE, build_parser, on_screen_size
from kvscope.app.main_window import (
    THREE_COLUMNS_FROM,
    TWO_COLUMNS_BELOW,
    MainWindow,
    arrangement_for,
    default_size,
    shown,
)
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


class FakeScreen:
    """A screen of a given free area, for default_size and --size."""

    def __init__(self, width: int, height: int) -> None:
        self.free = QRect(0, 0, width, height)

    def availableGeometry(self) -> QRect:
        return self.free


@pytest.mark.parametrize("screen", [(1280, 720), (1366, 768), (1920, 1080), (2560, 1440)])
def test_the_window_never_opens_larger_than_the_screen(screen):
    width, height = default_size(FakeScreen(*screen))
    assert width <= screen[0] and height <= screen[1]
    assert width >= min(screen[0], 1920) * 0.9  # still most of what the screen offers


def test_size_alone_is_cut_to_the_screen():
    args = build_parser().parse_args(["--size", "1600x900"])
    assert args.size == (1600, 900)
    assert on_screen_size(args.size, FakeScreen(1280, 720)) == (1280, 720)
    assert on_screen_size((800, 600), FakeScreen(1280, 720)) == (800, 600)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--size", "big"])


def test_arrangement_has_hysteresis():
    assert arrangement_for(1920, None) == "three" and arrangement_for(1366, None) == "two"
    assert arrangement_for(THREE_COLUMNS_FROM - 1, "two") == "two"
    assert arrangement_for(THREE_COLUMNS_FROM, "two") == "three"
    assert arrangement_for(TWO_COLUMNS_BELOW, "three") == "three"
    assert arrangement_for(TWO_COLUMNS_BELOW - 1, "three") == "two"


def test_the_arrangement_follows_a_resize(window_at, qapp):
    w = window_at(1920, 1080)
    assert w.arrangement == "three"
    for width in (1700, 1366):  # as a window edge is dragged: through the threshold
        w.resize(width, 768)
        qapp.processEvents()
    assert w.arrangement == "two" and w.current_arrangement() == "two"
    assert w.width() == 1366  # the narrower arrangement fits: nothing widened the window
    w.resize(1920, 1080)
    qapp.processEvents()
    assert w.current_arrangement() == "three"
    assert w.side_dock.width() >= w.side_dock.minimumWidth()


def test_a_saved_layout_that_does_not_fit_the_screen_is_discarded(qtbot, qapp, tmp_path):
    ini = str(tmp_path / "s.ini")
    first = MainWindow(attach="tcp://127.0.0.1:9",
                       settings=QSettings(ini, QSettings.Format.IniFormat))
    qtbot.addWidget(first)
    first.show()
    first.shutdown()  # saves the layout for this screen
    saved = QSettings(ini, QSettings.Format.IniFormat)
    assert saved.value("window/state") is not None
    saved.setValue("window/screen", "2560x1440")  # as if saved on a larger screen
    saved.sync()
    again = MainWindow(attach="tcp://127.0.0.1:9",
                       settings=QSettings(ini, QSettings.Format.IniFormat))
    qtbot.addWidget(again)
    assert again.needs_default_layout
    assert QSettings(ini, QSettings.Format.IniFormat).value("window/state") is None
    again.shutdown()


def test_long_status_text_does_not_widen_the_window(window_at, qapp):
    w = window_at(1366, 768)
    w.status.mark_dead("the engine at tcp://127.0.0.1:5599 stopped answering; " * 12)
    qapp.processEvents()
    assert w.width() == 1366
    assert w.minimumSizeHint().width() <= 1280
    label = w.status.engine_label
    assert label.elided_text().endswith("…") and label.toolTip().startswith("engine is dead")


def test_reset_layout_is_in_the_view_menu(window_at, qapp):
    w = window_at(1920, 1080)
    w.side_dock.setFloating(True)
    menus = {a.text().replace("&", ""): a.menu() for a in w.menuBar().actions()}
    actions = [a.text().replace("&", "") for a in menus["View"].actions()]
    assert "Reset layout" in actions
    w.reset_layout_action.trigger()
    qapp.processEvents()
    assert not w.side_dock.isFloating()
    # the first start's size for this screen (offscreen's is 800 px: the window's least width)
    free = w.screen().availableGeometry()
    assert w.width() <= max(free.width(), w.minimumSizeHint().width()) < 1280
    assert w.arrangement == arrangement_for(w.width(), None) == w.current_arrangement()
