"""What sets one decoder family's math apart from Llama's, read from its Hugging Face config.

Every family the engine runs is a pre-norm decoder with RoPE, grouped-query attention and a
gated MLP, or for Qwen3-MoE and Mixtral a mixture of such MLPs (engine.model.moe); the
differences are a handful of switches (this FamilySpec) plus how the checkpoint names and packs
its weights (engine.model.layer_weights). engine.model.support refuses, before any
weight is read, every config that needs more than these switches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                      "qwen3_moe", "mixtral")
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# The families the fused CPU decode covered before gemma/qwen3/phi3 came (see FamilySpec.plain).
PLAIN_FAMILIES = ("llama", "mistral", "qwen2")
# Families whose config.layer_types says which layers slide (Hugging Face reads it there); for
# mistral and phi3 config.sliding_window applies to every layer, whatever layer_types says.
LAYER_TYPED_FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3_text")
# Families whose sliding_window is config.sliding_window on every layer (Qwen3-MoE's config
# sets it to None unless use_sliding_window).
UNIFORM_WINDOW_FAMILIES = ("mistral", "phi3", "qwen3_moe", "mixtral")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# config field of the MLP activation -> the activations this engine implements under that name.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    activation: str            # "silu" or "gelu_tanh" (gated: act(gate) * up)
    embed_scale: float         # 1.0, or sqrt(hidden_size) for gemma (rounded to the dtype on use)
    qk_norm: bool              # qwen3, gemma3: per-head RMSNorm of q and k before RoPE
    sandwich_norms: bool       # gemma2/3: RMSNorm on the attention output and on the MLP output
    attn_softcap: float        # 0.0 = off (gemma2 attn_logit_softcapping)
    final_softcap: float       # 0.0 = off (gemma2 final_logit_softcapping)
    layer_windows: tuple[int, ...]  # per layer: 0 = global attention, W = sliding window of W

    @property
    def plain(self) -> bool:
        """Llama, Mistral or Qwen2 without a window: what the fused CPU decode covered before
        this round."""
        return self.model_type in PLAIN_FAMILIES and not any(self.layer_windows)


def activation_name(hf_config: PretrainedConfig) -> str:
    """The MLP activation's config value (gemma names the field hidden_activation)."""
    if hf_config.model_type in GEMMA_FAMILIES:
        return str(getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh")
    return str(getattr(hf_config, "hidden_act", "silu"))


def layer_windows(hf_config: PretrainedConfig) -> list[int]:
    """Per layer, the sliding window W (a query at p sees keys p - W < j <= p), 0 = global;
    as Hugging Face's attention modules of the family read it."""
    n = hf_config.num_hidden_layers
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    model_type = hf_config.model_type
    if model_type in UNIFORM_WINDOW_FAMILIES:
        return [window] * n
    types = getattr(hf_config, "layer_types", None)
    if model_type not in LAYER_TYPED_FAMILIES or types is None:
        return [0] * n
    return [window if t == "sliding_attention" else 0 for t in types[:n]]


def _cap(value: float | None) -> float:
    return float(value) if value else 0.0


def family_spec(hf_config: PretrainedConfig) -> FamilySpec:
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported: expected one of "
                         f"{', '.join(SUPPORTED_FAMILIES)}")
    act = activation_name(hf_config)
    if act not in ACTIVATIONS:
        raise ValueError(f"{model_type}: activation {act!r} is not supported: expected one of "
                         f"{', '.join(ACTIVATIONS)}")
    gemma = model_type in GEMMA_FAMILIES
    return FamilySpec(
        model_type=model_type,
        activation=ACTIVATIONS[act],
        embed_scale=math.sqrt(hf_config.hidden_size) if gemma else 1.0,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        sandwich_norms=gemma,
        # Gemma3's attention never passes its attn_logit_softcapping on (Hugging Face ignores
        # it), so only gemma2 caps scores.
        attn_softcap=_cap(getattr(hf_config, "attn_logit_softcapping", None))
        if model_type == "gemma2" else 0.0,
        final_softcap=_cap(getattr(hf_config, "final_logit_softcapping", None)) if gemma else 0.0,
        layer_windows=tuple(layer_windows(hf_config)),
    )
