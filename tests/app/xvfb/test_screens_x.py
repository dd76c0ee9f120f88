"""The window on small and large screens, each its own Xvfb with the window in a child
process (issue 23, items 6 and 7): it opens within the screen's free area, --size is cut to
it, and a layout saved on a larger screen is dropped on a smaller one."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.app.xvfb import xserver


def open_window(server: xserver.XServer, ini: str, *options: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.app.xvfb.window_probe", ini, *options],
                          env=server.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def inside(frame: list[int], free: list[int]) -> bool:
    x, y, w, h = frame
    fx, fy, fw, fh = free
    return fx <= x and fy <= y and x + w <= fx + fw and y + h <= fy + fh


@pytest.mark.parametrize("screen", [(1280, 720), (1366, 768), (2560, 1440)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_opens_within_the_screen(tmp_path, screen):
    with xserver.xvfb(*screen) as server:
        shown = open_window(server, str(tmp_path / "s.ini"))
    assert inside(shown["frame"], shown["free"]), shown
    expected = "three" if screen[0] >= 1850 else "two"
    assert shown["arrangement"] == expected


def test_size_alone_is_cut_to_the_screen(tmp_path):
    with xserver.xvfb(1280, 720) as server:
        shown = open_window(server, str(tmp_path / "s.ini"), "--size", "1920x1080")
        assert inside(shown["frame"], shown["free"]), shown
        smaller = open_window(server, str(tmp_path / "t.ini"), "--size", "1100x700")
    assert smaller["frame"][2:] == [1100, 700]


def test_a_layout_saved_on_a_larger_screen_is_dropped(tmp_path):
    ini = str(tmp_path / "s.ini")
    with xserver.xvfb(2560, 1440) as server:
        big = open_window(server, ini, "--size", "2500x1400")
    assert big["frame"][2] == 2500
    with xserver.xvfb(1280, 720) as server:
        small = open_window(server, ini)
    assert inside(small["frame"], small["free"]), small
    assert small["arrangement"] == "two"
