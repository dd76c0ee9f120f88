"""A real X server for the window's tests: start Xvfb on a free display, find why the xcb
platform cannot run here, drive windows with xdotool and take screenshots."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import PySide6

XCB_PLUGIN = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
FIRST_DISPLAY = 90  # clear of a desktop's :0 and of ssh's forwarded :10 and up


def missing_libraries(plugin: Path = XCB_PLUGIN) -> list[str]:
    """The shared libraries the xcb platform plugin needs and the loader cannot find."""
    if not plugin.is_file():
        return [str(plugin)]
    try:
        out = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []  # no ldd: let Qt itself say what fails
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def why_not_runnable() -> str | None:
    """Why these tests cannot run on this machine (None: they can)."""
    if shutil.which("Xvfb") is None:
        return "Xvfb is not installed (apt-get install xvfb)"
    missing = missing_libraries()
    if missing:
        return ("Qt's xcb platform plugin cannot load: missing " + ", ".join(missing)
                + " (see .ci/run for the packages)")
    return None


def _display_taken(n: int) -> bool:
    return Path(f"/tmp/.X{n}-lock").exists() or Path(f"/tmp/.X11-unix/X{n}").exists()


@dataclass
class XServer:
    display: str  # ":91"
    width: int
    height: int
    process: subprocess.Popen

    def env(self) -> dict[str, str]:
        """The environment for a child process that shows its windows on this server."""
        return {**os.environ, "DISPLAY": self.display, "QT_QPA_PLATFORM": "xcb"}


def _wait_for_socket(n: int, process: subprocess.Popen, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if Path(f"/tmp/.X11-unix/X{n}").exists():
            return True
        time.sleep(0.05)
    return False


def start_xvfb(width: int = 1920, height: int = 1080) -> XServer:
    """Xvfb at this screen size on the first free display number."""
    for n in range(FIRST_DISPLAY, FIRST_DISPLAY + 60):
        if _display_taken(n):
            continue
        process = subprocess.Popen(
            ["Xvfb", f":{n}", "-screen", "0", f"{width}x{height}x24", "-nolisten", "tcp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_for_socket(n, process):
            return XServer(f":{n}", width, height, process)
        stop_process(process)  # another run took that number meanwhile: try the next
    raise RuntimeError("no free X display number for Xvfb")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def xvfb(width: int, height: int) -> Iterator[XServer]:
    """A second X server at another screen size, for a window run in a child process."""
    server = start_xvfb(width, height)
    try:
        yield server
    finally:
        stop_process(server.process)


# -- xdotool --------------------------------------------------------------------------------
def xdotool(*args: str, display: str | None = None) -> str:
    env = {**os.environ, "DISPLAY": display} if display else None
    done = subprocess.run(["xdotool", *args], capture_output=True, text=True, timeout=30,
                          env=env)
    return done.stdout.strip()


def window_ids(*, title: str | None = None, pid: int | None = None,
               display: str | None = None, timeout: float = 20.0) -> list[str]:
    """X window ids of visible windows with this title (a regex) or of this process."""
    query = ["search", "--onlyvisible"]
    query += ["--pid", str(pid)] if pid is not None else ["--name", title or "."]
    deadline = time.monotonic() + timeout
    while True:
        found = xdotool(*query, display=display).split()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def window_size(wid: str, width: int, height: int, display: str | None = None) -> None:
    """Resize a window through the window system, as a person dragging its edge would."""
    xdotool("windowsize", wid, str(width), str(height), display=display)


def window_move(wid: str, x: int, y: int, display: str | None = None) -> None:
    xdotool("windowmove", wid, str(x), str(y), display=display)


def window_geometry(wid: str, display: str | None = None) -> tuple[int, int, int, int]:
    """(x, y, width, height) of a window as the X server has it."""
    out = xdotool("getwindowgeometry", "--shell", wid, display=display)
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return (int(values["X"]), int(values["Y"]), int(values["WIDTH"]), int(values["HEIGHT"]))


def key(wid: str, *keys: str, display: str | None = None) -> None:
    xdotool("key", "--window", wid, *keys, display=display)


def click(wid: str, x: int, y: int, button: int = 1, display: str | None = None) -> None:
    """A mouse click at (x, y) inside the window."""
    xdotool("mousemove", "--window", wid, str(x), str(y), display=display)
    xdotool("click", str(button), display=display)


# -- screenshots ------------------------------------------------------------------------------
def screenshot(path: Path, widget=None, display: str | None = None) -> Path:
    """The X server's screen (ImageMagick's `import`), else the widget's own grab()."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if shutil.which("import") and display:
        env = {**os.environ, "DISPLAY": display}
        done = subprocess.run(["import", "-window", "root", str(path)], env=env,
                              capture_output=True, timeout=60)
        if done.returncode == 0 and path.is_file():
            return path
    if widget is None:
        raise RuntimeError("no ImageMagick `import` and no widget to grab")
    if not widget.grab().save(str(path)):
        raise RuntimeError(f"could not save {path}")
    return path
