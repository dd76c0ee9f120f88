"""What "nothing cut or overlapping" means for the window, checked on a live MainWindow:
shared by the real-X layout tests."""
from __future__ import annotations

from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QLabel, QWidget

from kvscope.app.elided_label import ElidedLabel
from kvscope.app.main_window import MainWindow, shown


def rect_in_window(window: MainWindow, widget: QWidget) -> QRect:
    """The widget's rectangle in the window's coordinates."""
    return QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())


def within_window(window: MainWindow, widget: QWidget) -> bool:
    return window.rect().contains(rect_in_window(window, widget))


def clipped_labels(root: QWidget) -> list[str]:
    """Shown labels narrower than their text (eliding and wrapping ones may be)."""
    out = []
    for label in root.findChildren(QLabel):
        if (isinstance(label, ElidedLabel) or label.wordWrap() or not shown(label)
                or not label.text() or label.pixmap() is not None and not label.pixmap().isNull()):
            continue
        need = label.minimumSizeHint().width()
        if label.width() < need:
            out.append(f"{label.text()[:40]!r}: {label.width()} < {need} px")
    return out


def plots_cut(layout_widget) -> list[str]:
    """Plots of a pyqtgraph grid that reach past the widget showing them (a grid wider than its
    area: its right column, titles and x axis cut off)."""
    view = layout_widget.rect()
    out = []
    for item in layout_widget.ci.items:
        rect = layout_widget.mapFromScene(item.sceneBoundingRect()).boundingRect()
        if not shown(layout_widget):
            continue
        if rect.right() > view.right() + 1 or rect.bottom() > view.bottom() + 1:
            title = item.titleLabel.text if hasattr(item, "titleLabel") else type(item).__name__
            out.append(f"plot {title[:30]!r} at {rect} reaches past its area {view}")
    return out


def layout_problems(window: MainWindow, screen: QRect) -> list[str]:
    """Everything a person would see as cut, hidden or off-screen, as sentences."""
    problems = []
    if not screen.contains(window.frameGeometry()):
        problems.append(f"window {window.frameGeometry()} is not within the screen {screen}")
    for dock in (window.chat_dock, window.side_dock):
        if shown(dock) and not within_window(window, dock):
            problems.append(f"{dock.windowTitle()} dock {rect_in_window(window, dock)} "
                            f"sticks out of the window {window.rect()}")
        if shown(dock) and dock.width() < dock.minimumWidth():
            problems.append(f"{dock.windowTitle()} dock is {dock.width()} px, "
                            f"below its {dock.minimumWidth()} px")
    if not (shown(window.status) and within_window(window, window.status)):
        problems.append("the status bar is not wholly in view")
    if not shown(window.block_map):
        problems.append("the block map is hidden")
    elif window.block_map.width() < 0.4 * window.width():
        problems.append(f"the block map has only {window.block_map.width()} of "
                        f"{window.width()} px")
    problems += [f"clipped label {c}" for c in clipped_labels(window.status)]
    problems += plots_cut(window.plots.layout_widget)
    problems += plots_cut(window.device_panel.plots.layout_widget)
    return problems
