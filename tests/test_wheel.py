"""The wheel installs one import name, `kvscope`, and every module of the root's folders in it."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"kvscope": "kvscope", "engine": "kvscope/engine", "kernels": "kvscope/kernels",
          "ipc": "kvscope/ipc", "app": "kvscope/app", "kvmath": "kvscope/kvmath"}


def checkout_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied to dest: the
    wheel is built there, because setuptools reuses build/lib, where a module deleted from the
    checkout lives on and would land in a wheel built in place."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    source = checkout_copy(tmp_path_factory.mktemp("source"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(source)], check=True, capture_output=True)
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
                for path in (ROOT / folder).rglob(pattern)}
    assert expected - names == set()


def test_the_wheel_has_no_benchmarks(wheel):
    """benchmarks/ is run from a checkout (`python -m benchmarks.serving.soak`); what the
    commands need of it lives in engine/measure/."""
    assert [n for n in wheel.namelist() if "benchmarks" in n.split("/")[:-1]] == []
    assert "kvscope/engine/measure/bench.py" in wheel.namelist()
    assert "kvscope/engine/cli/kv_accuracy.py" in wheel.namelist()
