"""Tiny randomly initialised checkpoints (seeded) saved like a real one, for fast tests."""
from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_model(path: Path, arch: str = "llama", seed: int = 0, vocab_size: int = 256,
                    **overrides) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "eos_token_id": vocab_size - 1,
              "bos_token_id": vocab_size - 2,
              # Peaked logits: with the default 0.02 a random model's top two logits often
              # differ by ~1e-6, and greedy comparisons would test float noise, not code.
              "initializer_range": 0.3}
    common.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path)
    # A byte-level tokenizer whose ids are bytes (ids >= 256 would be special).
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{vocab_size - 1}>")
    fast.save_pretrained(path)
    return path
