"""Tests for the startup preflight that names the xcb plugin's missing libraries."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvscope.app import preflight

LDD_MISSING = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /opt/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f01)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f02)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibfancy-thing.so.7 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f03)
"""


def test_missing_from_ldd_lists_each_not_found_library_once() -> None:
    assert preflight.missing_from_ldd(LDD_MISSING) == [
        "libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libfancy-thing.so.7"]


def test_packages_name_the_debian_packages_and_keep_unknown_files() -> None:
    missing = preflight.packages_for(preflight.missing_from_ldd(LDD_MISSING))
    assert missing.packages == ["libxcb-icccm4", "libxcb-keysyms1"]
    assert missing.unknown == ["libfancy-thing.so.7"]
    text = preflight.message_for(missing)
    assert "apt-get install libxcb-icccm4 libxcb-keysyms1" in text
    assert "libfancy-thing.so.7" in text
    assert "libxcb-cursor0" not in text  # installed: not blamed, unlike Qt's message


@pytest.mark.parametrize(("env", "platform", "expected"), [
    ({"DISPLAY": ":0"}, "linux", True),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, "linux", True),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux", False),
    ({}, "linux", False),
    ({"DISPLAY": ":0"}, "darwin", False),
])
def test_only_checks_when_qt_will_use_xcb(env: dict, platform: str, expected: bool) -> None:
    assert preflight.will_use_xcb(env, platform) is expected


def test_exit_code_and_stderr_when_libraries_are_missing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DISPLAY", ":99")
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(preflight, "ldd_output", lambda _path: LDD_MISSING)
    if preflight.xcb_plugin_path() is None:
        pytest.skip("PySide6 has no libqxcb.so here")
    assert preflight.preflight_exit_code() == 2
    assert "libxcb-keysyms1" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ldd is Linux-only")
def test_this_machines_xcb_plugin_check_agrees_with_ldd() -> None:
    """On this machine, whatever it has installed: the check blames exactly the libraries
    ldd itself (run here, not through preflight) cannot find, and nothing when it finds all.
    (.ci/run installs them where it can; a machine without them must still pass.)"""
    plugin = preflight.xcb_plugin_path()
    assert plugin is not None and plugin.name == "libqxcb.so"
    ldd = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True, check=True).stdout
    assert "libQt6XcbQpa" in ldd
    not_found = sorted({line.split("=>")[0].strip() for line in ldd.splitlines()
                        if line.rstrip().endswith("=> not found")})
    missing = preflight.check_xcb_plugin()
    if not_found:
        assert missing is not None
        assert sorted(missing.libraries) == not_found
    else:
        assert missing is None
