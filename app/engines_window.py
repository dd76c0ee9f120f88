"""Several engines in one window, one tab each (kvscope's own window, a vLLM or llama-server
window); the status bar and the title name the engine shown."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QMainWindow, QTabWidget


def page_label(page) -> str:
    source = getattr(page, "source", None)
    if source is not None:
        return source.label
    attached = getattr(page, "attach_endpoints", None)
    return f"kvscope at {attached[0]}" if attached else "kvscope (local engine)"


class EnginesWindow(QMainWindow):
    def __init__(self, pages: list) -> None:
        super().__init__()
        self.setObjectName("kvscopeEnginesWindow")
        self.pages = pages
        self.closed = False
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        for page in pages:
            page.setWindowFlags(Qt.WindowType.Widget)  # a window inside a tab
            self.tabs.addTab(page, page_label(page))
        self.setCentralWidget(self.tabs)
        self.shown_label = QLabel()
        self.statusBar().addWidget(self.shown_label)
        self.tabs.currentChanged.connect(self.show_page)
        self.show_page(0)

    def show_page(self, index: int) -> None:
        label = page_label(self.pages[index]) if 0 <= index < len(self.pages) else ""
        others = len(self.pages) - 1
        self.shown_label.setText(f"showing {label} · watching {others} more "
                                 f"engine{'s' if others != 1 else ''}")
        self.setWindowTitle(f"kvscope — {label}")

    def start(self) -> None:
        for page in self.pages:
            page.start()

    def repaint_views(self) -> None:
        for page in self.pages:
            page.repaint_views()

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for page in self.pages:
            page.shutdown()

    def closeEvent(self, event) -> None:
        self.shutdown()
        super().closeEvent(event)
