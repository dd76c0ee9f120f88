"""Screenshots of one engine's life in a real X server, to look at (issue 53): the window at a
screen size with its local engine started, a chat streamed, the engine killed with `kill -9`,
then restarted. `python -m tests.app.xvfb.engine_cycle_screens OUT_DIR [WxH ...]` writes
OUT_DIR/cycle-WxH-<stage>.png for the stages streaming, dead, restarting and restarted.

Each size runs in a child process on its own Xvfb (this module with --child), so a window is
laid out for the screen it is on, as a user's would be."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.app.xvfb import xserver

ROOT = Path(__file__).resolve().parents[3]
PROMPT = ("Write a Python function that splits a list into pages of a fixed size, with a "
          "docstring, and a test for it.")


def child(out: Path, size: str) -> int:
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from kvscope.app.main import STYLE
    from kvscope.app.main_window import MainWindow

    app = QApplication(["kvscope"])
    app.setStyleSheet(STYLE.read_text())
    folder = out / f"settings-{size}"
    folder.mkdir(parents=True, exist_ok=True)
    w = MainWindow(engine_args=["--model", "default", "--device", "cpu"],
                   settings=QSettings(str(folder / "s.ini"), QSettings.Format.IniFormat))
    w.show()

    def wait(until, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            app.processEvents()
            if until():
                return True
            time.sleep(0.02)
        return until()

    def shot(stage: str) -> None:
        wait(lambda: False, 0.6)  # a few frames of the clock: labels and plots repainted
        w.repaint_views()
        w.refresh_labels()
        app.processEvents()
        path = out / f"cycle-{size}-{stage}.png"
        w.screen().grabWindow(0).save(str(path))
        print(path, flush=True)

    w.start()
    if not wait(lambda: w.hello is not None, 600):
        print("the engine did not start", file=sys.stderr)
        return 1
    w.chat.max_tokens.setValue(400)
    w.chat.temperature.setValue(0.0)
    w.chat.input.setPlainText(PROMPT)
    w.chat.send()
    wait(lambda: w.chat.conversation().turn is not None
         and w.chat.conversation().turn.num_output > 60, 240)
    shot("streaming")
    os.kill(w.engine.pid(), signal.SIGKILL)  # as `kill -9` from a terminal
    wait(lambda: w.status.state == "dead", 30)
    wait(lambda: False, 3.5)  # past a heartbeat timeout: the first reason must stay
    shot("dead")
    w.status.restart_button.click()
    wait(lambda: False, 1.0)
    shot("restarting")
    wait(lambda: w.hello is not None and w.block_map.stale is None, 600)
    shot("restarted")
    w.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--child":
        return child(Path(argv[1]), argv[2])
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for size in argv[1:] or ["1280x720", "1920x1080"]:
        width, height = (int(v) for v in size.split("x"))
        data = out / f"data-{size}"  # its chats: never the user's own folder
        with xserver.xvfb(width, height) as server:
            subprocess.run([sys.executable, "-m", "tests.app.xvfb.engine_cycle_screens",
                            "--child", str(out), size],
                           env={**server.env(), "XDG_DATA_HOME": str(data)}, check=True,
                           timeout=1500, cwd=ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
