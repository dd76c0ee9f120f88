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
ENGINE_SUBPACKAGES = {"cli", "server", "traces", "scheduling", "kv_cache", "model", "loading",
                      "spec_decode", "measure", "cuda_graphs"}
# engine/'s own modules: the engine loop, config and the LLM API, and the request's types.
MAX_ENGINE_TOP_MODULES = 12
OUTER = {"cli", "server", "traces"}


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layer_names() -> set[str]:
    layers = next(c for c in contracts() if c["type"] == "layers")["layers"]
    return {name.strip() for layer in layers for name in re.split(r"[:|]", layer)}


def engine_subpackages(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_every_engine_module_and_subpackage_sits_in_a_layer():
    top = {f"kvscope.engine.{p.stem}" for p in (ROOT / "engine").glob("*.py")
           if p.stem != "__init__"}
    subs = {f"kvscope.engine.{name}" for name in engine_subpackages(ROOT / "engine")}
    named = {n for n in layer_names() if n.startswith("kvscope.engine.")}
    assert top | subs == named


def test_engine_keeps_a_dozen_modules_at_its_top():
    top = [p for p in (ROOT / "engine").glob("*.py") if p.stem != "__init__"]
    assert len(top) <= MAX_ENGINE_TOP_MODULES, sorted(p.stem for p in top)


def test_engine_has_only_the_named_subpackages():
    assert engine_subpackages(ROOT / "engine") == ENGINE_SUBPACKAGES


def test_no_contract_names_one_module_of_an_engine_subpackage():
    """The contracts and the mypy list speak of the subpackages, so a module added to one is
    covered without an edit (and a renamed one cannot drop out unnoticed)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = set(layer_names())
    for c in contracts():
        for key in ("source_modules", "forbidden_modules", "modules", "ancestors"):
            names.update(c.get(key, []))
    for override in config["tool"]["mypy"]["overrides"]:
        names.update(m for m in override["module"] if not m.endswith(".*"))
    deep = sorted(n for n in names for sub in ENGINE_SUBPACKAGES - OUTER
                  if n.startswith(f"kvscope.engine.{sub}."))
    assert deep == []


def test_engine_tests_mirror_the_engine_subpackages():
    """tests/engine/<folder> exists only for an engine subpackage of that name (model/fused for
    engine/model/fused), so a reader finds a module's tests where its folder says."""
    tests = ROOT / "tests" / "engine"
    folders = {p.relative_to(tests) for p in tests.rglob("*") if p.is_dir()
               and (p / "__init__.py").exists()}
    assert folders, "tests/engine has no subfolders"
    assert all((ROOT / "engine" / f / "__init__.py").exists() for f in folders), folders


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


BARE = re.compile(r"^\s*(?:from|import)\s+(engine|kernels|ipc|app|kvmath)\b", re.MULTILINE)
# benchmarks/ is not installed, so `benchmarks.serving.soak` has no second copy to clash with:
# the developer benchmarks and their tests import it by that name, run from the repository's
# root. What is installed must not import it at all.
BENCHMARKS = re.compile(r"^\s*(?:from|import)\s+benchmarks\b", re.MULTILINE)


def test_nothing_imports_a_root_folder_by_its_bare_name():
    """The folders are installed as kvscope.engine, kvscope.app, ...: a bare `import engine`
    works only from the repository's root, and would load a second copy of the module."""
    found = [f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
             for pkg in (*PACKAGES, "benchmarks", "tests")
             for path in (ROOT / pkg).rglob("*.py")
             for m in BARE.finditer(path.read_text())]
    assert found == []


def test_only_the_benchmarks_and_tests_import_the_benchmarks():
    found = [f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
             for pkg in PACKAGES
             for path in (ROOT / pkg).rglob("*.py")
             for m in BENCHMARKS.finditer(path.read_text())]
    assert found == []
