"""Refuse, from the config alone and before any weight is read, every model whose math the
engine does not implement: computing a different model silently would be worse than failing.

The engine runs dense decoders with RoPE and grouped-query attention (engine.model.family);
each refusal names the model_type or config field at fault and what is supported. The rules
themselves live in kvmath.model_support, torch-free, so that the window applies exactly
these before it loads a model (File > Open model).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.kvmath import model_support

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILIES = model_support.FAMILIES
ROPE_TYPES = model_support.ROPE_TYPES


def check_supported(hf_config: PretrainedConfig, max_model_len: int | None = None) -> None:
    """Raise ValueError naming the model_type / field the engine does not implement."""
    model_support.check_supported(hf_config, max_model_len)
