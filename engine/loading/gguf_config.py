"""What a GGUF file says about its model that transformers' GGUF reader drops.

transformers builds the config of a GGUF from a fixed table of keys per architecture
(integrations/ggml.py) and leaves every other field at its config class's default. For the
families the engine runs that silently changes the model: Qwen3's head_dim (128 whatever the
file says), Gemma 2's logit caps, the query scale of the 27B Gemmas, Gemma 3's RoPE scaling
and layer pattern, Phi-3's sliding window, partial rotary and longrope factors, Qwen3-MoE's
expert width (moe_intermediate_size, 768 whatever the file says). This module
reads those fields from the file, as llama.cpp writes and reads them, and puts them back into
the config before the model is built; what it cannot put back it refuses, by name.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# llama.cpp takes the 27B Gemmas' query scale from hidden_size / heads (their head_dim is
# smaller), every other size's from head_dim; it tells the 27B ones by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class GGUFFacts:
    """A GGUF file's metadata (scalars and short arrays) and its tensor names."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import read_field

        reader = GGUFReader(str(path))
        self.fields: dict[str, Any] = {}
        for key in reader.fields:
            if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.model":
                continue  # vocabularies: large, and transformers reads them itself
            # read_field: transformers' own parsing, a list of values (one for a scalar).
            values = read_field(reader, key)  # type: ignore[no-untyped-call]
            self.fields[key] = values[0] if len(values) == 1 else values
        self.arch = str(self.fields.get("general.architecture", ""))
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str) -> Any:
        """`{arch}.key`, or None."""
        return self.fields.get(f"{self.arch}.{key}")

    def tensor_values(self, name: str) -> list[float] | None:
        t = self.tensors.get(name)
        return None if t is None else [float(x) for x in t.data.reshape(-1)]


def check_readable(facts: GGUFFacts) -> None:
    """Files transformers fails on with an unhelpful message, or reads into another model:
    say what is wrong."""
    experts = facts.get("expert_count")
    if facts.arch == "llama" and experts:
        # transformers reads a llama GGUF as a dense Llama and drops the ffn_*_exps tensors
        # it maps to nothing: the model would run without its experts.
        raise ValueError(f"this GGUF is a mixture of experts in the llama architecture "
                         f"(llama.expert_count={experts}: llama.cpp writes Mixtral so); "
                         "transformers' GGUF reader maps no experts for llama and would load "
                         "it as a dense model without them, so it is refused: load the "
                         "model's Hugging Face folder instead")
    if facts.arch == "llama" and facts.fields.get("general.name") == "mistral":
        raise ValueError("this GGUF is a llama file named exactly 'mistral', which transformers "
                         "reads as Mistral and then cannot map to tensors; give general.name "
                         "another value (llama.cpp's Mistral files are plain llama files)")


def restore_config(config: Any, facts: GGUFFacts) -> list[str]:
    """Put back into `config` (a transformers config read from the file) what the file says
    and transformers dropped; returns one line per field restored."""
    notes: list[str] = []

    def put(name: str, value: Any) -> None:
        if getattr(config, name, None) != value:
            notes.append(f"{name}: {getattr(config, name, None)!r} -> {value!r}")
            setattr(config, name, value)

    key_length = facts.get("attention.key_length")
    if key_length and hasattr(config, "head_dim"):
        put("head_dim", int(key_length))
    if facts.arch in ("gemma2", "gemma3"):
        _restore_gemma(config, facts, put)
    if facts.arch == "phi3":
        _restore_phi3(config, facts, put, notes)
    expert_width = facts.get("expert_feed_forward_length")
    if facts.arch == "qwen3moe" and expert_width:
        put("moe_intermediate_size", int(expert_width))
    return notes


def _restore_gemma(config: Any, facts: GGUFFacts, put: Any) -> None:
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = facts.get(cap)
        if value is not None:
            put(cap, float(value))
    heads, hidden = config.num_attention_heads, config.hidden_size
    big = config.num_hidden_layers == _GEMMA_27B_LAYERS[facts.arch]
    put("query_pre_attn_scalar", hidden // heads if big else config.head_dim)
    if facts.arch != "gemma3":
        return
    pattern = facts.get("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == config.num_hidden_layers:
        put("layer_types", ["sliding_attention" if p else "full_attention" for p in pattern])
    scaling = facts.get("rope.scaling.type")
    if scaling is None or scaling == "none":
        return
    if scaling != "linear":
        raise ValueError(f"this Gemma 3 GGUF scales RoPE by {scaling!r}: only 'linear' "
                         "(what Gemma 3 uses) is carried into the converted model")
    factor = facts.get("rope.scaling.factor")
    if not factor:
        raise ValueError("this Gemma 3 GGUF scales RoPE linearly but states no factor")
    params = {k: dict(v) for k, v in (config.rope_parameters or {}).items()}
    full: dict[str, Any] = params.get("full_attention", {})
    theta = facts.get("rope.freq_base") or full.get("rope_theta", 10000.0)
    full.update(rope_type="linear", factor=float(factor), rope_theta=float(theta))
    params["full_attention"] = full
    put("rope_parameters", params)


def _restore_phi3(config: Any, facts: GGUFFacts, put: Any, notes: list[str]) -> None:
    window = facts.get("attention.sliding_window")
    if window:
        put("sliding_window", int(window))
    head_dim = config.hidden_size // config.num_attention_heads
    params = dict(config.rope_parameters or {})
    before = dict(params)
    dims = facts.get("rope.dimension_count")
    if dims:
        params["partial_rotary_factor"] = int(dims) / head_dim
    long, short = (facts.tensor_values(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if (long is None) != (short is None):
        raise ValueError("this Phi-3 GGUF has only one of rope_factors_long/short: cannot "
                         "rebuild its longrope scaling")
    if long is not None and short is not None:
        original = facts.get("rope.scaling.original_context_length")
        if not original:
            raise ValueError("this Phi-3 GGUF has longrope factors but no "
                             "rope.scaling.original_context_length")
        params.update(rope_type="longrope", long_factor=long, short_factor=short,
                      original_max_position_embeddings=int(original))
        put("original_max_position_embeddings", int(original))
        _check_attn_factor(facts, config.max_position_embeddings / int(original))
    if params != before:
        notes.append(f"rope_parameters: {before!r} -> {params!r}")
        config.rope_parameters = params


def _check_attn_factor(facts: GGUFFacts, factor: float) -> None:
    """Hugging Face derives longrope's attention factor from the context ratio; a file that
    states another one describes another model."""
    stated = facts.get("rope.scaling.attn_factor")
    if stated is None or factor <= 1.0:
        return
    original = facts.get("rope.scaling.original_context_length")
    derived = math.sqrt(1 + math.log(factor) / math.log(original))
    if not math.isclose(float(stated), derived, rel_tol=1e-4):
        raise ValueError(f"this Phi-3 GGUF states a longrope attention factor {stated} where "
                         f"its context ratio gives {derived:.6f}: not carried")
