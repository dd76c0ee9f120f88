"""The mouse wheel over a numeric field scrolls the side panel unless the field has focus
(issue 53: scrolling the KV calculator took its headroom from 5 % to 0 %)."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QPoint, QPointF, QSettings, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication, QScrollArea

from kvscope.app.main_window import MainWindow


@pytest.fixture
def window(qtbot, qapp, tmp_path):
    w = MainWindow(attach="tcp://127.0.0.1:9",
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    w.resize(1280, 500)  # short: the Engine tab scrolls
    w.show()
    qtbot.waitExposed(w)
    w.activateWindow()
    qtbot.waitActive(w)
    yield w
    w.shutdown()


def wheel_down(widget) -> None:
    """One notch of the wheel at the field's centre (sent to the field: Qt hands a spin box's
    line edit's wheel to the spin box, but only for a real, spontaneous event)."""
    pos = QPointF(widget.rect().center())
    event = QWheelEvent(pos, QPointF(widget.mapToGlobal(pos.toPoint())), QPoint(0, 0),
                        QPoint(0, -120), Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                        Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def scroll_area_of(widget) -> QScrollArea:
    w = widget.parentWidget()
    while not isinstance(w, QScrollArea):
        w = w.parentWidget()
    return w


def show_tab(window, panel) -> QScrollArea:
    area = scroll_area_of(panel)
    window.side_dock.raise_()
    window.side_tabs.setCurrentWidget(area)
    QApplication.processEvents()
    return area


def test_wheel_over_unfocused_calculator_field_keeps_its_value(window, qapp):
    field = window.kv_calculator.context
    area = show_tab(window, window.kv_calculator)
    area.ensureWidgetVisible(field)
    field.setValue(4096)
    window.setFocus()
    QApplication.processEvents()
    wheel_down(field)
    assert field.value() == 4096


def test_wheel_over_unfocused_engine_combo_scrolls_the_panel(window, qapp):
    combo = window.controls.block_size
    area = show_tab(window, window.controls)
    bar = area.verticalScrollBar()
    assert bar.maximum() > 0, "the Engine tab must be taller than its dock here"
    bar.setValue(0)
    before = combo.currentIndex()
    window.setFocus()
    QApplication.processEvents()
    wheel_down(combo)
    assert combo.currentIndex() == before
    assert bar.value() > 0  # the wheel went to the scroll area


def test_a_focused_field_still_takes_the_wheel(window, qapp):
    field = window.kv_calculator.context
    show_tab(window, window.kv_calculator)
    scroll_area_of(window.kv_calculator).ensureWidgetVisible(field)
    field.setValue(4096)
    field.setFocus()
    QApplication.processEvents()
    assert field.hasFocus()
    wheel_down(field)
    assert field.value() != 4096
    assert field.focusPolicy() == Qt.FocusPolicy.StrongFocus
