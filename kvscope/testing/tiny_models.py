"""Tiny randomly initialised checkpoints (seeded) saved like a real one, for fast tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "qwen3_moe",
         "mixtral")
# Small windows, so that test prompts run past them.
WINDOW = 8
PHI3_MAX_LEN = 256

# Per family: what makes its tiny model exercise the family's own math.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    # Layer 0 global, layer 1 sliding.
    "qwen3": {"head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW,
              "max_window_layers": 1},
    "mistral": {"sliding_window": WINDOW},
    # Caps that bite (scores and logits of these random weights reach them), a query scalar
    # that is not head_dim, sliding layers every other one (Hugging Face's default).
    "gemma2": {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": WINDOW,
               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
               "final_logit_softcapping": 15.0},
    # Local layers at base 10000, global ones at 1e6 with linear scaling.
    "gemma3_text": {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": WINDOW,
                    "query_pre_attn_scalar": 24,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                    "sliding_attention"],
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 1000000.0}}},
    # Half the head turns; longrope's short factors and its attention factor (from
    # max_position_embeddings / original_max_position_embeddings = 2). The engine runs it
    # up to original_max_position_embeddings (PHI3_MAX_LEN, engine.model.support).
    "phi3": {"original_max_position_embeddings": 256, "max_position_embeddings": 512,
             "pad_token_id": 0,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5,
                                 "original_max_position_embeddings": 256,
                                 "short_factor": [1.0, 1.3, 1.7, 2.2],
                                 "long_factor": [2.0, 3.0, 5.0, 8.0]}},
    # 8 experts, top-2: a batch's tokens spread over most experts (Mixtral's experts are
    # intermediate_size wide, Qwen3-MoE's moe_intermediate_size).
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
}


def save_tiny_model(path: Path, arch: str = "llama", seed: int = 0, vocab_size: int = 256,
                    **overrides: Any) -> Path:
    """A tiny random `arch` checkpoint plus a byte-level tokenizer in `path`. The new families
    (all but llama and qwen2, whose weights stay as they were) get random norm weights too, so
    that a norm read as w instead of 1 + w (gemma) or a q/k norm skipped changes the output."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: expected one of {ARCHS}")
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "eos_token_id": vocab_size - 1,
        "bos_token_id": vocab_size - 2,
        # Peaked logits: with the default 0.02 a random model's top two logits often
        # differ by ~1e-6, and greedy comparisons would test float noise, not code.
        "initializer_range": 0.3}
    common.update(FAMILY_OVERRIDES[arch])
    common.update(overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **common))
    if arch not in ("llama", "qwen2"):
        _randomize_norms(model)
    model.save_pretrained(path)
    _save_tokenizer(path, vocab_size)
    return path


def _randomize_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A byte-level tokenizer whose ids are bytes (ids >= 256 would be special).
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{vocab_size - 1}>")
    fast.save_pretrained(path)
