"""RoPE cos/sin tables for every position, computed by the family's own transformers rotary
module, so every rope type it implements (linear, llama3, yarn, longrope, partial rotary...)
matches the reference bit for bit.

Two rope types change with the sequence length inside Hugging Face, and a fixed table matches
them only up to a length, which engine.model.support makes max_model_len respect: "dynamic"
(rescaled once the sequence outgrows max_position_embeddings) and "longrope" (the short
factors while the sequence fits original_max_position_embeddings; past it Phi-3's generate
drops its cache and recomputes every position with the long factors).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ROTARY_CLASSES = {
    "llama": ("llama", "LlamaRotaryEmbedding"),
    "mistral": ("mistral", "MistralRotaryEmbedding"),
    "qwen2": ("qwen2", "Qwen2RotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3RotaryEmbedding"),
    "gemma2": ("gemma2", "Gemma2RotaryEmbedding"),
    "gemma3_text": ("gemma3", "Gemma3RotaryEmbedding"),
    "phi3": ("phi3", "Phi3RotaryEmbedding"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeRotaryEmbedding"),
    "mixtral": ("mixtral", "MixtralRotaryEmbedding"),
}
# Gemma3's layers take one of two rope setups by layer type (a dict of them in rope_parameters).
PER_LAYER_TYPE = ("gemma3_text",)


def rope_parameters(hf_config: PretrainedConfig, layer_type: str | None = None
                    ) -> dict[str, Any]:
    """The rope setup of a layer type (gemma3) or of the model: rope_type, rope_theta, ..."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if hf_config.model_type in PER_LAYER_TYPE:
        params = params.get(layer_type or "full_attention") or {}
    return dict(params)


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def _rotary_module(hf_config: PretrainedConfig) -> Any:
    module, name = ROTARY_CLASSES.get(hf_config.model_type, ROTARY_CLASSES["llama"])
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    return cls(config=hf_config)


def _cos_sin(hf_config: PretrainedConfig, start: int, stop: int, layer_type: str | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    # A fresh module per call: dynamic and longrope rotaries change their state as they run.
    rotary = _rotary_module(hf_config)
    positions = torch.arange(start, stop)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    extra = (layer_type,) if hf_config.model_type in PER_LAYER_TYPE else ()
    cos, sin = rotary(probe, positions, *extra)
    return cos[0], sin[0]


def rope_tables(hf_config: PretrainedConfig, num_positions: int, dtype: torch.dtype,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_positions, rotary_dim] as Hugging Face's rotary module gives them
    (rotary_dim < head_dim under a partial_rotary_factor). `layer_type` picks gemma3's
    "sliding_attention" (local base frequency) or "full_attention" setup."""
    if hf_config.model_type in PER_LAYER_TYPE and layer_type is None:
        layer_type = "full_attention"
    cos, sin = _cos_sin(hf_config, 0, num_positions, layer_type)
    return cos.to(dtype), sin.to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: engine.model.paged_decoder.apply_rope's form of
    rotate_half."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
