"""The wheel installs one import name, `kvscope`, and every module of the root's folders in it."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"kvscope": "kvscope", "engine": "kvscope/engine", "kernels": "kvscope/kernels",
          "ipc": "kvscope/ipc", "app": "kvscope/app", "kvmath": "kvscope/kvmath",
          "benchmarks": "kvscope/benchmarks"}
NOT_INSTALLED = ("benchmarks/device/", "benchmarks/experiments/")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (path,) = out.glob("kvscope-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_has_one_top_level_name(wheel):
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["kvscope"]
    roots = {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" not in n}
    assert roots == {"kvscope"}


def test_every_source_file_of_the_mapped_folders_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    expected = {f"{MAPPED[folder]}/{path.relative_to(ROOT / folder).as_posix()}"
                for folder in MAPPED
                for pattern in ("*.py", "*.c", "*.h")
                for path in (ROOT / folder).rglob(pattern)
                if not path.relative_to(ROOT).as_posix().startswith(NOT_INSTALLED)}
    assert expected - names == set()
    assert not any(n.startswith(("kvscope/benchmarks/device/", "kvscope/benchmarks/experiments/"))
                   for n in names)
