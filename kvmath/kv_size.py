"""KV cache size for any Hugging Face config: bytes per token and for a whole context."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8")  # canonical names, aliases below
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "int8": 1, "fp8": 1}
QUANTIZED = {"int8", "fp8"}
SCALE_BYTES = 4  # one float32 scale per (token, kv_head) for int8/fp8


@dataclass
class KVSize:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: int

    def total_bytes(self, tokens: int) -> int:
        return self.bytes_per_token * tokens


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


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """From a Hugging Face config.json dict (text_config for multimodal ones)."""
    cfg = config.get("text_config", config)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return ModelShape(int(cfg["num_hidden_layers"]), int(kv_heads), int(head_dim))


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
    return KVSize(shape.layers, shape.kv_heads, shape.head_dim, dtype, per_token)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
