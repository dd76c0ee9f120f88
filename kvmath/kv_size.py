"""KV cache size for any Hugging Face config: bytes per token and for a whole context."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.kvmath.kv_dtypes import ONE_BYTE_KV_DTYPES, STORED_KV_DTYPES
from kvscope.kvmath.windows import layer_windows, window_summary

KV_DTYPES = STORED_KV_DTYPES  # canonical names (kv_dtypes.py), aliases below
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "int8": 1, "fp8": 1}
QUANTIZED = frozenset(ONE_BYTE_KV_DTYPES)
SCALE_BYTES = 4  # one float32 scale per (token, kv_head) for int8/fp8


@dataclass
class KVSize:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: int
    windowed_layers: int = 0
    window: int = 0

    def total_bytes(self, tokens: int) -> int:
        """Every one of `tokens` tokens' K and V (many sequences, or one with no window)."""
        return self.bytes_per_token * tokens

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.layers, self.kv_heads, self.head_dim, self.windowed_layers,
                          self.window)

    def sequence_bytes(self, tokens: int) -> int:
        """What one sequence of `tokens` keeps: capped at the window for an all-windowed
        model."""
        return self.bytes_per_token * sequence_tokens_held(self.shape, tokens)


def load_config(source: str | dict[str, Any]) -> dict[str, Any]:
    """A config dict, a JSON string, a config.json path or a checkpoint folder."""
    if isinstance(source, dict):
        return source
    text = source.strip()
    if text.startswith("{"):
        return _json_object(text, source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--config {source!r}: not a JSON object, config.json or checkpoint "
                         "folder")
    return _json_object(path.read_text(), source)


def _json_object(text: str, source: str) -> dict[str, Any]:
    config = json.loads(text)
    if isinstance(config, dict):
        return config
    # A ValueError like every other bad --config (the command reports those), not a TypeError.
    raise ValueError(f"--config {source!r}: holds JSON, but not an object")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    # Layers attending through a sliding window (kvmath.windows) and that window; 0, 0: none.
    windowed_layers: int = 0
    window: int = 0

    @property
    def all_windowed(self) -> bool:
        """Every layer slides the same window: the engine frees blocks behind it."""
        return self.window > 0 and self.windowed_layers == self.layers

    @property
    def mixed_windows(self) -> bool:
        """Some layers slide a window and some attend globally (Gemma 2/3, partly windowed
        Qwen2): the engine keeps one full block table for every layer."""
        return self.window > 0 and 0 < self.windowed_layers < self.layers


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """From a Hugging Face config.json dict (text_config for multimodal ones). head_dim is
    the config's own when it has one (Qwen3, Gemma: num_heads x head_dim != hidden_size)."""
    cfg = config.get("text_config", config)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    windowed, window = window_summary(layer_windows(cfg))
    return ModelShape(int(cfg["num_hidden_layers"]), int(kv_heads), int(head_dim),
                      windowed, window)


def sequence_tokens_held(shape: ModelShape, tokens: int) -> int:
    """KV tokens one sequence of `tokens` keeps: capped at the window when every layer slides
    it (the engine frees what lies behind), all of them otherwise."""
    return min(tokens, shape.window) if shape.all_windowed else tokens


def sequence_blocks(shape: ModelShape, tokens: int, block_size: int) -> int:
    """Blocks one sequence of `tokens` holds at most while it decodes. All-windowed: the
    window's keys plus the one being written span at most ceil((W - 1) / bs) + 1 blocks."""
    full = -(-max(1, tokens) // block_size)
    if not shape.all_windowed:
        return full
    return min(full, -(-(shape.window - 1) // block_size) + 1)


def reclamation_saving(shape: ModelShape, tokens: int) -> float:
    """For a mixed model, the fraction of its KV that freeing blocks per layer (not done:
    one block table serves every layer) would save on a `tokens`-long sequence: the
    windowed layers' share times what lies behind their window, (1 - W / tokens)."""
    if not shape.mixed_windows or tokens <= shape.window:
        return 0.0
    return shape.windowed_layers / shape.layers * (1 - shape.window / tokens)


def window_note(shape: ModelShape, tokens: int) -> str:
    """One sentence on what sliding windows mean for the KV of a `tokens`-long sequence
    ("" for a model without them)."""
    if shape.all_windowed:
        return (f"every layer slides a {shape.window:,}-token window: a sequence's KV is "
                f"capped at {shape.window:,} tokens (blocks behind the window are freed), "
                f"here {sequence_tokens_held(shape, tokens):,} of {tokens:,}")
    if shape.mixed_windows:
        return (f"{shape.windowed_layers} of {shape.layers} layers slide a "
                f"{shape.window:,}-token window; the engine keeps full block tables for "
                f"mixed models: per-layer reclamation would save "
                f"{100 * reclamation_saving(shape, tokens):.1f}% at {tokens:,} tokens")
    return ""


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is unknown: expected one of {sorted(DTYPE_BYTES)}")


def bytes_per_token(shape: ModelShape, dtype: str, with_scales: bool = True) -> int:
    """2 x layers x kv_heads x head_dim x bytes (+ a float scale per token and head if int8/fp8)."""
    check_dtype(dtype)
    per_head = shape.head_dim * DTYPE_BYTES[dtype]
    if with_scales and dtype in QUANTIZED:
        per_head += SCALE_BYTES
    return 2 * shape.layers * shape.kv_heads * per_head


def kv_size(config: dict[str, Any], dtype: str, with_scales: bool = True) -> KVSize:
    check_dtype(dtype)
    shape = shape_from_config(config)
    per_token = bytes_per_token(shape, dtype, with_scales)
    return KVSize(shape.layers, shape.kv_heads, shape.head_dim, dtype, per_token,
                  shape.windowed_layers, shape.window)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
