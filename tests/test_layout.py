"""The house rules the import contracts cannot state alone: every core module is in a layer,
every module says what it is for, and the launcher reaches the GUI without torch."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "ipc", "app", "kvmath", "kvscope")
ENGINE_SUBPACKAGES = {"cli", "server", "traces"}


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def core_layer() -> set[str]:
    layers = next(c for c in contracts() if c["type"] == "layers")["layers"]
    core = next(layer for layer in layers if "kvscope.engine.llm_engine" in layer)
    return {name.strip() for name in core.replace("\n", " ").split(":")}


def test_every_engine_core_module_sits_in_the_core_layer():
    top = {f"kvscope.engine.{p.stem}" for p in (ROOT / "engine").glob("*.py")
           if p.stem != "__init__"}
    assert top == core_layer()


def test_engine_has_only_the_named_subpackages():
    subs = {p.name for p in (ROOT / "engine").iterdir()
            if p.is_dir() and (p / "__init__.py").exists()}
    assert subs == ENGINE_SUBPACKAGES


def test_no_contract_needs_an_exception():
    assert all("ignore_imports" not in c for c in contracts())


def test_every_module_opens_with_a_line_saying_what_it_is_for():
    missing = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
            if not doc or not doc.splitlines()[0].strip():
                missing.append(str(path.relative_to(ROOT)))
    assert missing == []


def test_the_launcher_reaches_the_gui_without_torch_or_the_engine():
    code = ("import sys, kvscope.main, kvscope.app.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
            "or m.startswith(('kvscope.engine', 'kvscope.kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


BARE = re.compile(r"^\s*(?:from|import)\s+(engine|kernels|ipc|app|kvmath|benchmarks)\b",
                  re.MULTILINE)


def test_nothing_imports_a_root_folder_by_its_bare_name():
    """The folders are installed as kvscope.engine, kvscope.app, ...: a bare `import engine`
    works only from the repository's root, and would load a second copy of the module."""
    found = [f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
             for pkg in (*PACKAGES, "benchmarks", "tests")
             for path in (ROOT / pkg).rglob("*.py")
             for m in BARE.finditer(path.read_text())]
    assert found == []
