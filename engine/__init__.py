"""kvscope's inference engine: continuous batching over a paged KV cache.

The public names load lazily so that the `kvscope` command can start the GUI or print --help
without importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from kvscope import __version__

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta", "__version__"]

_WHERE = {"LLM": "kvscope.engine.llm", "EngineConfig": "kvscope.engine.config",
          "SamplingParams": "kvscope.engine.sampling_params",
          "RequestOutput": "kvscope.engine.outputs", "TokenDelta": "kvscope.engine.outputs"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvscope.engine' has no attribute {name!r}")
