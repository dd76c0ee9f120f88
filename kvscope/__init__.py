"""kvscope: see and steer what a local LLM inference engine does with its KV cache.

The one installed import name. Its subpackages live in the repository's root folders
(`kvscope.engine` is engine/, `kvscope.app` is app/, ...; pyproject's package-dir). The launcher
(`kvscope.main`) is the only module that may import both the window and the engine. The engine's
public names load lazily, so `import kvscope` costs no torch.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta", "__version__"]

try:
    __version__ = version("kvscope")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("kvscope.engine"), name)
    raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
