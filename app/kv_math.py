"""KV cache arithmetic for the calculator panel (the app may not import the engine's).

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element, plus one
float32 scale per token, kv head, layer and K/V for int8/fp8."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Pure Python and torch-free (the engine package loads lazily): the one allowed engine import.
from engine.fragsim import FragResult, simulate

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
QUANTIZED = {"int8", "fp8"}
SCALE_BYTES = 4
DISTRIBUTIONS = ("uniform", "exponential", "lognormal", "fixed")

# Shapes of well-known models: (layers, kv_heads, head_dim).
PRESETS = {
    "SmolLM2-135M (embedded)": (30, 3, 64),
    "Llama-3.1-8B": (32, 8, 128),
    "Qwen2-7B": (28, 4, 128),
    "Mistral-7B": (32, 8, 128),
    "Llama-2-7B (no GQA)": (32, 32, 128),
    "Llama-3.1-70B": (80, 8, 128),
}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int


def shape_from_config(cfg: dict) -> ModelShape:
    """From a Hugging Face config.json dict (text_config for multimodal ones)."""
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return ModelShape(int(cfg["num_hidden_layers"]), int(kv_heads), int(head_dim))


def bytes_per_token(shape: ModelShape, dtype: str) -> int:
    per_head = shape.head_dim * DTYPE_BYTES[dtype]
    if dtype in QUANTIZED:
        per_head += SCALE_BYTES
    return 2 * shape.layers * shape.kv_heads * per_head


def sample_lengths(dist: str, mean: int, max_len: int, n: int, seed: int) -> list[int]:
    """n request lengths (prompt + reply tokens) in 1..max_len, seeded."""
    rng = random.Random(seed)
    mean = max(1, min(mean, max_len))
    out = []
    for _ in range(n):
        if dist == "uniform":
            x = rng.uniform(1, min(max_len, 2 * mean))
        elif dist == "exponential":
            x = rng.expovariate(1 / mean)
        elif dist == "lognormal":
            sigma = 1.0
            x = rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)
        else:
            x = mean
        out.append(int(min(max_len, max(1, round(x)))))
    return out


def compare(lengths: list[int], max_len: int, block_size: int) -> FragResult:
    """Reserved-max-length vs paged waste: the very code behind `kvscope fragsim`."""
    return simulate(lengths, block_size, max_len)
