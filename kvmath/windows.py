"""Which layers of a Hugging Face config attend through a sliding window, from config.json alone.

Pure (no torch, no transformers), so the window's calculator and `kvscope kv-calc` read the
same answer the engine acts on. A layer's window W means a query at position p sees keys
p - W < j <= p; 0 means global attention.
"""
from __future__ import annotations

from typing import Any

# Families whose sliding_window applies to every layer, whatever layer_types says (as their
# Hugging Face attention reads it; engine.model.family agrees).
_UNIFORM = ("mistral", "mixtral", "phi3", "starcoder2", "qwen3_moe")
# Gemma 2 alternates sliding and global layers, sliding first; Gemma 3 slides five of six.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def layer_windows(config: dict[str, Any]) -> list[int]:
    """Per layer: the sliding window, or 0 for global attention."""
    cfg = config.get("text_config", config)
    layers = int(cfg["num_hidden_layers"])
    window = int(cfg.get("sliding_window") or 0)
    if window <= 0 or cfg.get("use_sliding_window") is False:
        return [0] * layers
    if cfg.get("model_type") in _UNIFORM:
        return [window] * layers
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        return [window if t == "sliding_attention" else 0 for t in types]
    pattern = cfg.get("sliding_window_pattern") or _DEFAULT_PATTERN.get(cfg.get("model_type", ""))
    if pattern:
        return [window if (i + 1) % int(pattern) else 0 for i in range(layers)]
    if cfg.get("model_type") in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers") or 0)
        return [window if i >= first else 0 for i in range(layers)]
    return [0] * layers  # llama and the like: a sliding_window field is not read


def uniform_window(windows: list[int]) -> int:
    """W when every layer slides the same window W, so whole blocks behind it can be freed
    for good; 0 for global or mixed models (those keep every block)."""
    if windows and windows[0] > 0 and all(w == windows[0] for w in windows):
        return windows[0]
    return 0


def window_summary(windows: list[int]) -> tuple[int, int]:
    """(number of windowed layers, the largest window) - 0, 0 for an all-global model."""
    sliding = [w for w in windows if w > 0]
    return len(sliding), max(sliding, default=0)
