"""Which models the engine computes, decided from the config alone: the refusal rules that
engine.model.support applies at load and the window applies before it loads anything.

Mixtures of experts run for Qwen3-MoE and Mixtral, whose routing engine.model.moe computes
(which layers are sparse is decided here, once for the engine and the window); any other MoE
model type, and any routing variant set in one of theirs (shared experts, another scoring
function, group-limited or scaled routing), is refused naming the field.

Pure Python (no torch, no transformers): a check reads its config through attributes, so it
takes a transformers PretrainedConfig (the engine) or config_view(config.json's dict) (the
window) alike; each refusal names the model_type or config field at fault and what is
supported. engine.model.family and engine.model.rope hold the same names for the engine's
math; tests/engine/model/test_unsupported_models.py keeps the two in step.
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                      "qwen3_moe", "mixtral")
# The mixtures of experts among them (engine.model.moe routes as their Hugging Face code does).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# config field of the MLP activation -> the activations the engine implements under that name.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Gemma3's layers take one of two rope setups by layer type (a dict of them in rope_parameters).
PER_LAYER_TYPE = ("gemma3_text",)

FAMILIES = ", ".join(SUPPORTED_FAMILIES)
# Rope types whose tables transformers' rotary modules compute and engine.model.rope keeps.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
              "num_experts_per_tok", "shared_expert_intermediate_size", "n_shared_experts")
# Routing variants neither MoE family's Hugging Face code computes: set in a qwen3_moe or
# mixtral config, they describe another model (scoring_func "softmax" and a
# routed_scaling_factor of 1 are what the families do).
MOE_VARIANT_FIELDS = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "topk_method": "a top-k method",
    "scoring_func": "a router scoring function",
    "n_group": "group-limited routing",
    "topk_group": "group-limited routing",
    "routed_scaling_factor": "scaled routing weights",
    "e_score_correction_bias": "a routing bias",
}
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


def activation_name(cfg: Any) -> str:
    """The MLP activation's config value (gemma names the field hidden_activation)."""
    if cfg.model_type in GEMMA_FAMILIES:
        return str(getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh")
    return str(getattr(cfg, "hidden_act", "silu"))


def rope_parameters(cfg: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope setup of a layer type (gemma3) or of the model: rope_type, rope_theta, ..."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if cfg.model_type in PER_LAYER_TYPE:
        params = params.get(layer_type or "full_attention") or {}
    return dict(params)


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def config_view(config: dict[str, Any]) -> SimpleNamespace:
    """config.json's dict as the checks read a config: its fields as attributes, and
    rope_parameters as transformers derives it from an older file's rope_scaling."""
    fields = dict(config)
    if not fields.get("rope_parameters"):
        scaling = dict(fields.get("rope_scaling") or {})
        if fields.get("model_type") in PER_LAYER_TYPE:
            fields["rope_parameters"] = {"full_attention": scaling,
                                         "sliding_attention": {"rope_type": "default"}}
        else:
            fields["rope_parameters"] = scaling
    fields.setdefault("model_type", "")
    return SimpleNamespace(**fields)


def _truthy(value: Any) -> bool:
    return bool(value) and value not in ("none", "None")


def _fail(cfg: Any, what: str) -> None:
    raise ValueError(f"model_type {cfg.model_type!r}: {what} is not supported "
                     f"(the engine runs the decoder families {FAMILIES})")


def num_experts(cfg: Any) -> int:
    """The expert count under either name (transformers aliases Qwen3-MoE's num_experts to
    num_local_experts, Mixtral's name; config.json may hold either); 0 for a dense model."""
    return int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
               or 0)


def sparse_layers(cfg: Any) -> tuple[bool, ...]:
    """Per layer, whether it is a mixture of experts, as the family's Hugging Face decoder
    layer decides: every layer of a Mixtral; for Qwen3-MoE, when there are experts, the layers
    outside mlp_only_layers whose index + 1 is a multiple of decoder_sparse_step; no layer of
    a dense family."""
    n = int(cfg.num_hidden_layers)
    if cfg.model_type == "mixtral":
        return (True,) * n
    if cfg.model_type != "qwen3_moe" or num_experts(cfg) <= 0:
        return (False,) * n
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", None) or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def _moe_variants(cfg: Any) -> list[str]:
    """What a qwen3_moe / mixtral config sets that their routing does not compute."""
    out = []
    for name, what in MOE_VARIANT_FIELDS.items():
        value = getattr(cfg, name, None)
        if not _truthy(value) or (name == "scoring_func" and value == "softmax") or (
                name == "routed_scaling_factor" and value == 1):
            continue
        out.append(f"{what} ({name}={value!r})")
    experts, top_k = num_experts(cfg), getattr(cfg, "num_experts_per_tok", None)
    if top_k is not None and experts and not 0 < int(top_k) <= experts:
        out.append(f"num_experts_per_tok={top_k} with {experts} experts")
    step = getattr(cfg, "decoder_sparse_step", None)
    if cfg.model_type == "qwen3_moe" and step is not None and int(step) < 1:
        out.append(f"decoder_sparse_step={step!r} (at least 1)")
    return out


def _check_kind(cfg: Any) -> None:
    """The kinds of model that are no dense text decoder at all (all that apply are named)."""
    model_type = str(cfg.model_type)
    kinds: list[str] = []
    moe = [f for f in MOE_FIELDS if _truthy(getattr(cfg, f, None))]
    if model_type in MOE_FAMILIES:
        kinds += [f"a mixture-of-experts variant: {v}" for v in _moe_variants(cfg)]
    elif moe or "moe" in model_type or model_type in ("dbrx", "gpt_oss"):
        kinds.append(f"mixture of experts ({', '.join(moe) or 'model type'}; the engine routes "
                     f"as {' and '.join(MOE_FAMILIES)} do)")
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


def _rope_length_limit(cfg: Any, params: dict[str, Any]) -> tuple[int, str]:
    """The longest sequence a fixed rope table serves as Hugging Face does (0: any)."""
    kind = rope_type(params)
    if kind == "dynamic":
        return int(cfg.max_position_embeddings), "max_position_embeddings"
    if kind == "longrope":
        original = (params.get("original_max_position_embeddings")
                    or getattr(cfg, "original_max_position_embeddings", None))
        return int(original or cfg.max_position_embeddings), "original_max_position_embeddings"
    return 0, ""


def _check_rope(cfg: Any, max_model_len: int | None) -> None:
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


def _check_family_fields(cfg: Any) -> None:
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


CHECKS: tuple[Callable[[Any], None], ...] = (_check_kind, _check_family_fields)


def check_supported(cfg: Any, max_model_len: int | None = None) -> None:
    """Raise ValueError naming the model_type / field the engine does not implement."""
    for check in CHECKS:
        check(cfg)
    _check_rope(cfg, max_model_len)


def refusal(config: dict[str, Any], max_model_len: int | None = None) -> str | None:
    """Why the engine would refuse config.json's model (None: it runs it)."""
    try:
        check_supported(config_view(config), max_model_len)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # A field missing or of the wrong type: the engine would not load it either.
        return str(exc) if isinstance(exc, ValueError) else f"config.json: {exc!r}"
    return None
