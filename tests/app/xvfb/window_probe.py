"""Run in a child process on a given X server: open the window as `kvscope gui` would
(attached to nothing, with the given settings file and --size), let it settle, print its
geometry and the screen's free area as JSON, close it (saving its layout)."""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from kvscope.app.main import STYLE, build_parser, on_screen_size
    from kvscope.app.main_window import MainWindow

    ini, *options = argv
    args = build_parser().parse_args(options)
    app = QApplication([])
    app.setStyleSheet(STYLE.read_text())
    window = MainWindow(attach="tcp://127.0.0.1:9",
                        settings=QSettings(ini, QSettings.Format.IniFormat))
    if args.size:
        window.resize(*on_screen_size(args.size, window.screen()))
        window.center_on_screen()
    window.show()

    def report() -> None:
        frame, free = window.frameGeometry(), window.screen().availableGeometry()
        print(json.dumps({"frame": [frame.x(), frame.y(), frame.width(), frame.height()],
                          "free": [free.x(), free.y(), free.width(), free.height()],
                          "arrangement": window.arrangement}))
        window.close()

    QTimer.singleShot(1500, report)
    app.exec()
    window.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
