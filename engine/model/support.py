"""Refuse, from the config alone and before any weight is read, every model whose math the
engine does not implement: computing a different model silently would be worse than failing.

The engine runs dense decoders with RoPE and grouped-query attention (engine.model.family);
each refusal names the model_type or config field at fault and what is supported.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvscope.engine.model.family import (
    ACTIVATIONS,
    ATTENTION_LAYER_TYPES,
    GEMMA_FAMILIES,
    SUPPORTED_FAMILIES,
    activation_name,
)
from kvscope.engine.model.rope import PER_LAYER_TYPE, rope_parameters, rope_type

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILIES = ", ".join(SUPPORTED_FAMILIES)
# Rope types whose tables transformers' rotary modules compute and engine.model.rope keeps.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
              "num_experts_per_tok")
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")
VISION_FIELDS = ("vision_config", "vision_tower", "mm_tokens_per_image", "image_token_id",
                 "image_token_index")
VISION_TYPES = ("gemma3", "gemma3n", "paligemma", "mllama", "pixtral", "mistral3", "llama4")
VISION_MARKERS = ("llava", "idefics", "vision", "_vl")
HYBRID_TYPES = ("qwen3_next", "mamba", "jamba", "zamba", "falcon_h1", "bamba", "lfm2",
                "recurrent_gemma", "rwkv")
# Fields that change the math when set to a true value, and what the engine does instead.
UNSUPPORTED_FLAGS = {
    "use_bidirectional_attention": "causal attention only",
}


def _truthy(value: Any) -> bool:
    return bool(value) and value not in ("none", "None")


def _fail(hf_config: PretrainedConfig, what: str) -> None:
    raise ValueError(f"model_type {hf_config.model_type!r}: {what} is not supported "
                     f"(the engine runs dense decoders of the families {FAMILIES})")


def _check_kind(cfg: PretrainedConfig) -> None:
    """The kinds of model that are no dense text decoder at all (all that apply are named)."""
    model_type = str(cfg.model_type)
    kinds: list[str] = []
    moe = [f for f in MOE_FIELDS if _truthy(getattr(cfg, f, None))]
    if moe or "moe" in model_type or model_type in ("mixtral", "dbrx", "gpt_oss"):
        kinds.append(f"mixture of experts ({', '.join(moe) or 'model type'})")
    mla = [f for f in MLA_FIELDS if _truthy(getattr(cfg, f, None))]
    if mla or "deepseek" in model_type:
        kinds.append(f"multi-head latent attention ({', '.join(mla) or 'model type'})")
    vision = [f for f in VISION_FIELDS if getattr(cfg, f, None) is not None]
    if vision or model_type in VISION_TYPES or any(t in model_type for t in VISION_MARKERS):
        kinds.append(f"a vision tower ({', '.join(vision) or 'model type'}; for gemma3 save "
                     "the text model, Gemma3ForCausalLM with a Gemma3TextConfig)")
    if any(t in model_type for t in HYBRID_TYPES):
        kinds.append("hybrid linear/recurrent attention (model type)")
    types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
    if other:
        kinds.append(f"layer_types {other} (hybrid linear attention; supported layer types: "
                     f"{', '.join(ATTENTION_LAYER_TYPES)})")
    sinks = [name for name, value in vars(cfg).items() if "sink" in name and _truthy(value)]
    if sinks:
        kinds.append(f"attention sinks ({', '.join(sinks)})")
    if kinds:
        _fail(cfg, "; ".join(kinds))
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported: expected one of "
                         f"{FAMILIES}")


def _check_rope(cfg: PretrainedConfig, max_model_len: int | None) -> None:
    layer_types = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    setups = ([rope_parameters(cfg, t) for t in layer_types]
              if cfg.model_type in PER_LAYER_TYPE else [rope_parameters(cfg)])
    for params in setups:
        kind = rope_type(params)
        if kind not in ROPE_TYPES:
            _fail(cfg, f"rope_scaling / rope_parameters rope_type {kind!r} (supported: "
                       f"{', '.join(ROPE_TYPES)})")
        if "mrope_section" in params or params.get("mrope_interleaved"):
            _fail(cfg, "multimodal rope (rope_parameters mrope_section)")
        limit, field = _rope_length_limit(cfg, params)
        if limit and max_model_len is not None and max_model_len > limit:
            _fail(cfg, f"rope_type {kind!r} past {field}={limit} (max_model_len="
                       f"{max_model_len}: Hugging Face changes its frequencies with the "
                       f"sequence length there, a fixed table cannot; use max_model_len <= "
                       f"{limit})")


def _rope_length_limit(cfg: PretrainedConfig, params: dict[str, Any]) -> tuple[int, str]:
    """The longest sequence a fixed rope table serves as Hugging Face does (0: any)."""
    kind = rope_type(params)
    if kind == "dynamic":
        return int(cfg.max_position_embeddings), "max_position_embeddings"
    if kind == "longrope":
        original = (params.get("original_max_position_embeddings")
                    or getattr(cfg, "original_max_position_embeddings", None))
        return int(original or cfg.max_position_embeddings), "original_max_position_embeddings"
    return 0, ""


def _check_family_fields(cfg: PretrainedConfig) -> None:
    act = activation_name(cfg)
    field = "hidden_activation" if cfg.model_type in GEMMA_FAMILIES else "hidden_act"
    if act not in ACTIVATIONS:
        _fail(cfg, f"{field}={act!r} (supported: {', '.join(ACTIVATIONS)})")
    for name, instead in UNSUPPORTED_FLAGS.items():
        if _truthy(getattr(cfg, name, None)):
            _fail(cfg, f"{name}={getattr(cfg, name)!r} (the engine implements {instead})")
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
    if kv_heads and heads % kv_heads:
        _fail(cfg, f"num_attention_heads={heads} not a multiple of num_key_value_heads="
                   f"{kv_heads}")


CHECKS: tuple[Callable[[PretrainedConfig], None], ...] = (_check_kind, _check_family_fields)


def check_supported(hf_config: PretrainedConfig, max_model_len: int | None = None) -> None:
    """Raise ValueError naming the model_type / field the engine does not implement."""
    for check in CHECKS:
        check(hf_config)
    _check_rope(hf_config, max_model_len)
