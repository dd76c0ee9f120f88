"""Startup preflight: name the shared libraries Qt's xcb plugin lacks, and the packages to install.

Qt's own message when libqxcb.so cannot load names libxcb-cursor0 whatever is really missing;
`ldd` on the plugin tells the truth, so the window checks it before QApplication exists."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Shared library file -> the Debian/Ubuntu package that ships it.
DEBIAN_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
}
EXIT_MISSING_LIBRARIES = 2


@dataclass(frozen=True)
class MissingLibraries:
    libraries: list[str]  # file names ldd could not resolve, in ldd's order
    packages: list[str]  # Debian/Ubuntu packages that ship them (known ones only)
    unknown: list[str]  # libraries no package is known for


def missing_from_ldd(output: str) -> list[str]:
    """The library names of ldd's `libfoo.so.1 => not found` lines, each once, in order."""
    missing: list[str] = []
    for line in output.splitlines():
        name, arrow, target = line.strip().partition("=>")
        if arrow and target.strip() == "not found" and name.strip() not in missing:
            missing.append(name.strip())
    return missing


def packages_for(libraries: list[str]) -> MissingLibraries:
    packages = [DEBIAN_PACKAGES[lib] for lib in libraries if lib in DEBIAN_PACKAGES]
    unknown = [lib for lib in libraries if lib not in DEBIAN_PACKAGES]
    return MissingLibraries(libraries, list(dict.fromkeys(packages)), unknown)


def message_for(missing: MissingLibraries) -> str:
    """What to tell the user: the missing files and the apt-get line that installs them."""
    lines = ["kvscope: error: Qt's X11 (xcb) platform plugin cannot load; these shared "
             "libraries are missing: " + ", ".join(missing.libraries)]
    if missing.packages:
        lines.append("  on Debian/Ubuntu install them with: sudo apt-get install "
                     + " ".join(missing.packages))
    if missing.unknown:
        lines.append("  no package known for: " + ", ".join(missing.unknown)
                     + " (install what provides them)")
    lines.append("  (or run without a display: QT_QPA_PLATFORM=offscreen)")
    return "\n".join(lines)


def will_use_xcb(environ: Mapping[str, str], platform: str) -> bool:
    """Qt picks xcb on Linux when nothing else is asked for and an X display is set."""
    qpa = environ.get("QT_QPA_PLATFORM", "")
    return (platform.startswith("linux") and qpa in ("", "xcb")
            and bool(environ.get("DISPLAY")))


def xcb_plugin_path() -> Path | None:
    """PySide6's libqxcb.so, found from the package folder without importing Qt itself."""
    import importlib.util

    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for sub in ("Qt/plugins/platforms", "plugins/platforms"):
            plugin = Path(folder) / sub / "libqxcb.so"
            if plugin.is_file():
                return plugin
    return None


def ldd_output(path: Path) -> str:
    """ldd's report on path ("" when ldd is missing or fails: the check then passes)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return ""
    try:
        done = subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def check_xcb_plugin() -> MissingLibraries | None:
    """The libraries libqxcb.so lacks, or None when nothing is missing (or nothing to check)."""
    plugin = xcb_plugin_path()
    if plugin is None:
        return None
    libraries = missing_from_ldd(ldd_output(plugin))
    return packages_for(libraries) if libraries else None


def preflight_exit_code() -> int | None:
    """Run before QApplication: on a display Qt would open with xcb, print what is missing to
    stderr and return the exit code; None when the window can start."""
    if not will_use_xcb(os.environ, sys.platform):
        return None
    missing = check_xcb_plugin()
    if missing is None:
        return None
    print(message_for(missing), file=sys.stderr)
    return EXIT_MISSING_LIBRARIES
