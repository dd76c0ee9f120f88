"""Published config.json fields of well-known models, for the calculator's presets: their KV
shape (kvmath.kv_size) and their parameters in total and per token (kvmath.model_params).

Each dict copies the fields these need from the model's config.json on the Hugging Face hub, as
published at the address in its comment; nothing here is downloaded.
"""
from __future__ import annotations

from typing import Any

# https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json
QWEN2_7B: dict[str, Any] = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
}

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (model card: 30.5B
# parameters in total, 3.3B activated)
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "sliding_window": None, "use_sliding_window": False, "attention_bias": False,
}

# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (Mistral's
# announcement: 46.7B parameters in total, 12.9B used per token)
MIXTRAL_8X7B: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "tie_word_embeddings": False, "max_position_embeddings": 32768, "sliding_window": None,
}

# Calculator preset name -> config.
CONFIGS = {"Qwen2-7B": QWEN2_7B, "Qwen3-30B-A3B (MoE)": QWEN3_30B_A3B,
           "Mixtral-8x7B (MoE)": MIXTRAL_8X7B}
