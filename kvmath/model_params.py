"""A model's parameters from config.json alone: in total (what its weights take in memory) and
active per token (what one token multiplies through: fewer in a mixture of experts).

Pure Python, for the calculator's "what fits" and its presets. Counted as the engine's families
lay their weights out (engine.model.layer_weights): embeddings, a head unless tied, per layer
q/k/v/o (with qwen2's q/k/v bias, or every projection's under attention_bias), a gated MLP of
three matrices, RMSNorm weights (q/k norms for qwen3 and Qwen3-MoE, gemma's sandwich norms).
A mixture-of-experts layer holds num_experts such MLPs of moe_intermediate_size (Mixtral:
intermediate_size) and a router [experts, hidden]; a token runs the router and top_k of the
experts. Active parameters count the embedding row and the head, as model cards do (Qwen3-30B-A3B
"3.3B activated", Mixtral-8x7B "12.9B active"): tests/kvmath/test_model_params.py checks both
against those cards and every total against Hugging Face's own model of a tiny config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.kvmath.model_support import config_view, num_experts, sparse_layers

QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
SANDWICH_FAMILIES = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int

    @property
    def moe(self) -> bool:
        return self.active < self.total


def _attention(cfg: Any) -> int:
    h, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or h // heads)
    q, k = heads * d, kv * d
    out = h * (q + 2 * k) + q * h
    if cfg.model_type == "qwen2":
        out += q + 2 * k
    elif getattr(cfg, "attention_bias", False):
        out += q + 2 * k + h
    if cfg.model_type in QK_NORM_FAMILIES:
        out += 2 * d
    return out


def _norms(cfg: Any) -> int:
    return (4 if cfg.model_type in SANDWICH_FAMILIES else 2) * int(cfg.hidden_size)


def _mlp(cfg: Any, intermediate: int) -> int:
    h = int(cfg.hidden_size)
    bias = 2 * intermediate + h if getattr(cfg, "mlp_bias", False) else 0
    return 3 * h * intermediate + bias


def _expert_size(cfg: Any) -> int:
    if cfg.model_type == "mixtral":
        return int(cfg.intermediate_size)
    return int(cfg.moe_intermediate_size)


def param_count(config: dict[str, Any]) -> ParamCount:
    """Total and active parameters of config.json's model (text_config for multimodal ones)."""
    cfg = config_view(config.get("text_config", config))
    h, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    embed = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2) + h
    total = active = embed
    experts = num_experts(cfg)
    for sparse in sparse_layers(cfg):
        layer = _attention(cfg) + _norms(cfg)
        if sparse:
            one, router = _mlp(cfg, _expert_size(cfg)), experts * h
            total += layer + experts * one + router
            active += layer + int(cfg.num_experts_per_tok) * one + router
        else:
            dense = _mlp(cfg, int(cfg.intermediate_size))
            total += layer + dense
            active += layer + dense
    return ParamCount(total, active)
