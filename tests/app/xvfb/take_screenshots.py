"""Take the window's screenshots in a real X server: one Xvfb per screen size, `kvscope gui
--demo --screenshot` in it at that size (the local engine, the load generator and a chat
running). `python -m tests.app.xvfb.take_screenshots [WxH ...]` writes
resources/screenshots/kvscope-WxH.png; docs/window.md shows them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.app.xvfb import xserver

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "resources" / "screenshots"
SIZES = ["1280x720", "1366x768", "1920x1080", "2560x1440"]


def shoot(size: str, after: float = 12.0, timeout: float = 600.0) -> Path:
    """One screenshot of the demo at this screen size, the window filling the screen."""
    width, height = (int(v) for v in size.split("x"))
    path = OUT / f"kvscope-{size}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    with xserver.xvfb(width, height) as server:
        subprocess.run(
            [sys.executable, "-m", "kvscope", "gui", "--demo", "--screenshot", str(path),
             "--after", str(after), "--size", size], env=server.env(), check=True,
            timeout=timeout, cwd=ROOT)
    return path


def main(argv: list[str]) -> int:
    for size in argv or SIZES:
        print(shoot(size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
