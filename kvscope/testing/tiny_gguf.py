"""Write a tiny Hugging Face model as an F32 GGUF file, the way llama.cpp's converter lays
one out, so that tests can load it back through transformers' GGUF reader.

Only what transformers reads back is written: its GGUF config keys (integrations/ggml.py),
the tensors under the names its own HF <-> GGUF map gives (get_gguf_hf_weights_map), with
llama.cpp's transforms undone by transformers' readers applied forward (Llama's q/k row
permutation, Gemma's 1 + w norms), and a byte-level "gpt2" vocabulary whose ids are bytes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

# HF model_type -> GGUF general.architecture (llama.cpp writes Mistral as llama).
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
             "qwen3_moe": "qwen3moe"}
# Families whose head_dim llama.cpp also writes as rope.dimension_count.
_ROPE_DIMS = {"llama", "mistral"}


def write_tiny_gguf(hf_model: Any, path: Path, name: str | None = None) -> Path:
    """Write hf_model (a *ForCausalLM with a 256-token byte vocabulary) to path. name:
    general.name (default: the model type; "Mistral tiny" for Mistral, which transformers
    then reads as the llama file it is)."""
    from gguf import GGUFWriter

    cfg = hf_model.config
    model_type = cfg.model_type
    if model_type not in GGUF_ARCH:
        raise ValueError(f"no GGUF layout for model_type {model_type!r}")
    arch = GGUF_ARCH[model_type]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name or ("Mistral tiny" if model_type == "mistral" else model_type))
    _write_config(writer, cfg, model_type)
    _write_vocab(writer, cfg)
    for name, tensor in gguf_tensors(hf_model).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_config(writer: Any, cfg: Any, model_type: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.to_dict().get("head_dim") is not None:  # llama.cpp: whenever the config has one
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if model_type in _ROPE_DIMS:
        writer.add_rope_dimension_count(head_dim)
    if model_type == "qwen3_moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if model_type in ("gemma2", "gemma3_text"):
        _write_gemma(writer, cfg)
    if model_type == "phi3":
        _write_phi3(writer, cfg, head_dim)


def _write_gemma(writer: Any, cfg: Any) -> None:
    writer.add_sliding_window(cfg.sliding_window)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(cfg, cap, None)
        if value is not None:
            writer.add_float32(f"{writer.arch}.{cap}", float(value))
    if cfg.model_type != "gemma3_text":
        return
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    full = (cfg.rope_parameters or {}).get("full_attention", {})
    if full.get("rope_type") == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))


def _write_phi3(writer: Any, cfg: Any, head_dim: int) -> None:
    params = cfg.rope_parameters or {}
    partial = float(params.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
    writer.add_sliding_window(int(cfg.sliding_window or 0))
    if params.get("rope_type") != "longrope":
        return
    original = int(params.get("original_max_position_embeddings")
                   or cfg.original_max_position_embeddings)
    ratio = cfg.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0)
    for kind in ("long", "short"):
        factors = np.asarray(params[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        params = params.get("full_attention", params)
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def _write_vocab(writer: Any, cfg: Any) -> None:
    """Byte-level BPE without merges: token i is byte i in GPT-2's byte alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    tokens = [spelling[i] for i in range(cfg.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))  # 1: normal
    # No merges: transformers then derives them from the scores (none, for single bytes).
    writer.add_token_scores([0.0] * len(tokens))
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    writer.add_eos_token_id(int(eos))
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(int(cfg.bos_token_id))
    if getattr(cfg, "pad_token_id", None) is not None:
        writer.add_pad_token_id(int(cfg.pad_token_id))
    writer.add_add_bos_token(False)


def gguf_tensors(hf_model: Any) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, for every tensor transformers maps back."""
    from transformers.modeling_gguf_pytorch_utils import (
        Qwen2MoeTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    cfg = hf_model.config
    gguf_type = "llama" if cfg.model_type == "mistral" else None
    # The MoE processor maps the stacked experts (llama.cpp's ffn_{gate,up,down}_exps).
    processor = Qwen2MoeTensorProcessor() if cfg.model_type == "qwen3_moe" else TensorProcessor()
    to_hf = get_gguf_hf_weights_map(hf_model, processor, model_type=gguf_type)
    state = hf_model.state_dict()
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out: dict[str, np.ndarray] = {}
    for gguf_name, hf_name in to_hf.items():
        if hf_name not in state or (tied and gguf_name == "output.weight"):
            continue
        w = state[hf_name].detach().float().numpy().copy()
        if gguf_name.endswith("_exps"):  # [experts, rows, cols], gate and up stacked in one
            half = w.shape[1] // 2
            part = {"gate": w[:, :half], "up": w[:, half:]}.get(gguf_name.split("_")[-2], w)
            out[gguf_name + ".weight"] = np.ascontiguousarray(part)
            continue
        out[gguf_name] = _forward_transform(cfg, gguf_name, w)
    return out


def _forward_transform(cfg: Any, name: str, w: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter does and transformers' reader undoes."""
    arch = GGUF_ARCH[cfg.model_type]
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
        return _permute(w, heads)
    if arch in ("gemma2", "gemma3") and "norm.weight" in name:
        return w + 1  # llama.cpp stores Gemma's (1 + w) norm weights whole
    return w


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves), per head."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
