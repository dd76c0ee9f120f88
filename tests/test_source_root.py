"""Run from a checkout, the root's folders do not shadow distributions of the same name.

`python -m` and `python -c` put the working directory first on sys.path; at a checkout's root
that offered kernels/ as the top-level `kernels`, which transformers >= 5.25 imports (a
dependency of its own), and every model load failed. kvscope/__init__.py moves the root last.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, kvscope, kernels, kvscope.kernels, tests.support
print(getattr(kernels, "WHO", "checkout"))
print(kvscope.kernels.__file__)
print(sys.path.index(sys.argv[1]) == len(sys.path) - 1)
"""


def probe_from_root(tmp_path) -> list[str]:
    """Import kvscope at the checkout's root with another `kernels` package on PYTHONPATH."""
    other = tmp_path / "other" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('WHO = "the distribution"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tmp_path / "other")
    done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


def test_kernels_is_the_distribution_and_kvscope_kernels_the_checkout(tmp_path):
    who, ours, root_last, _ = probe_from_root(tmp_path)
    assert who == "the distribution"
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert root_last == "True"


def test_an_installed_layout_leaves_the_path_alone(tmp_path):
    """Installed, kvscope/ holds engine/ itself: its parent is site-packages, never moved."""
    site = tmp_path / "site"
    (site / "kvscope" / "engine").mkdir(parents=True)
    (site / "kvscope" / "__init__.py").write_text((ROOT / "kvscope" / "__init__.py").read_text())
    (site / "pyproject.toml").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = str(site)
    code = "import sys, kvscope; print(sys.path.index(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"  # just after '' (the working directory), where it was
