"""kvscope's inference engine: continuous batching over a paged KV cache.

The public names load lazily so that `kvscope` (whose entry point lives here) can start the
GUI or print --help without importing torch.
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta"]
__version__ = "0.1.0"

_WHERE = {"LLM": "engine.llm", "EngineConfig": "engine.config",
          "SamplingParams": "engine.sampling_params", "RequestOutput": "engine.outputs",
          "TokenDelta": "engine.outputs"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
