"""kvscope: see and steer what a local LLM inference engine does with its KV cache.

The one installed import name. Its subpackages live in the repository's root folders
(`kvscope.engine` is engine/, `kvscope.app` is app/, ...; pyproject's package-dir). The launcher
(`kvscope.main`) is the only module that may import both the window and the engine. The engine's
public names load lazily, so `import kvscope` costs no torch.
"""
from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta", "__version__"]

# How long OpenMP's idle threads spin before they sleep (libgomp's GOMP_SPINCOUNT). Its own
# default, 300,000 rounds, made decode steps up to 20x slower whenever another process wanted
# a core (docs/threads.md; the benchmark that measured it: docs/notes/settled-experiments.md).
SPIN_COUNT = "1000"


def _default_omp_wait() -> None:
    """Set GOMP_SPINCOUNT before torch loads libgomp (it reads it once, then), unless the
    user set OpenMP's waiting or KVSCOPE_OMP_WAIT=as-is asks to leave it."""
    env = os.environ
    if env.get("KVSCOPE_OMP_WAIT") == "as-is" or "torch" in sys.modules:
        return
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT


_default_omp_wait()


def _demote_source_root() -> None:
    """Move a checkout's root to the end of sys.path, where `python -m` or pytest put it first.

    In a checkout our subpackages are the root's folders (engine/, kernels/, ...), importable
    only as kvscope.* (pyproject's package-dir). First on sys.path, the root would also offer
    them as top-level `kernels`, `engine`, `app`: transformers >= 5.25 imports the `kernels`
    distribution it requires and got ours. Installed, kvscope/ holds its subpackages and the
    path is left alone.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "engine")) or not os.path.isfile(
            os.path.join(root, "pyproject.toml")):
        return
    real_root = os.path.realpath(root)
    at_root = [p for p in sys.path if os.path.realpath(p or os.curdir) == real_root]
    if at_root:
        sys.path[:] = [p for p in sys.path if p not in at_root] + [root]


_demote_source_root()

try:
    __version__ = version("kvscope")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("kvscope.engine"), name)
    raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
