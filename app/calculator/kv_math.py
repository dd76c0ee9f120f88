"""KV cache arithmetic for the calculator panel, on top of kvmath (shared with the engine).

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element, plus one
float32 scale per token, kv head, layer and K/V for int8/fp8. "What fits": the KV memory this
device has left once the weights are loaded, as whole blocks and tokens per dtype and block
size, and as concurrent requests of a given length."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvscope.kvmath import kv_size, presets
from kvscope.kvmath.fragsim import FragResult, simulate
from kvscope.kvmath.kv_size import (  # noqa: F401 - ModelShape and the rest are the panel's too
    KV_DTYPES,
    ModelShape,
    bytes_per_token,
    reclamation_saving,
    sequence_blocks,
    sequence_tokens_held,
    shape_from_config,
    window_note,
)
from kvscope.kvmath.model_params import param_count

# The calculator offers the canonical dtype names only (kv_size also takes aliases: bf16, fp16).
DTYPE_BYTES = {d: kv_size.DTYPE_BYTES[d] for d in KV_DTYPES}
DISTRIBUTIONS = ("uniform", "exponential", "lognormal", "fixed")

# The mixtures of experts among the presets, read from their config.json (kvmath.presets).
MOE_PRESETS = ("Qwen3-30B-A3B (MoE)", "Mixtral-8x7B (MoE)")


def _config_shape(name: str) -> tuple[int, int, int]:
    shape = shape_from_config(presets.CONFIGS[name])
    return shape.layers, shape.kv_heads, shape.head_dim


# Shapes of well-known models: (layers, kv_heads, head_dim).
PRESETS = {
    "SmolLM2-135M (embedded)": (30, 3, 64),
    "Llama-3.1-8B": (32, 8, 128),
    "Qwen2-7B": (28, 4, 128),
    "Mistral-7B": (32, 8, 128),
    "Llama-2-7B (no GQA)": (32, 32, 128),
    "Llama-3.1-70B": (80, 8, 128),
    **{name: _config_shape(name) for name in MOE_PRESETS},  # 48 x 4 x 128, 32 x 8 x 128
}


# Parameters (billions) of the presets, for their weights in "what fits" on this device.
PRESET_PARAMS_B = {
    "SmolLM2-135M (embedded)": 0.135, "Llama-3.1-8B": 8.03, "Qwen2-7B": 7.62,
    "Mistral-7B": 7.24, "Llama-2-7B (no GQA)": 6.74, "Llama-3.1-70B": 70.6,
    # Every expert's weights stay in memory: what fits counts the total (30.5B and 46.7B).
    **{name: param_count(presets.CONFIGS[name]).total / 1e9 for name in MOE_PRESETS},
}
# What a token of a mixture of experts multiplies through (3.35B and 12.9B): its decode reads
# these bytes per token, not the total.
PRESET_ACTIVE_PARAMS_B = {name: param_count(presets.CONFIGS[name]).active / 1e9
                          for name in MOE_PRESETS}
WEIGHT_BYTES_PER_PARAM = 2  # bf16/fp16 weights, how such checkpoints ship


def preset_weights_bytes(name: str) -> int | None:
    params = PRESET_PARAMS_B.get(name)
    return None if params is None else int(params * 1e9 * WEIGHT_BYTES_PER_PARAM)


def swap_weights(available_bytes: int, loaded_weights: int, other_weights: int) -> int:
    """The KV memory with another model's weights in place of the loaded ones."""
    return max(0, available_bytes + loaded_weights - other_weights)


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


# -- what fits on this device ---------------------------------------------------------------
# Block sizes the engine accepts are powers of two up to 256 (engine/config.py); the table
# shows the ones people actually pick.
FIT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
# Kept back from the KV cache, as a fraction of the device's total memory: one step's
# activations and logits, the allocator's fragmentation, and room for other programs to grow.
# vLLM keeps 10 % of the card (gpu_memory_utilization=0.9) besides the activations it profiles;
# here the starting point is memory already free, weights and other programs excluded, so a
# smaller default margin suffices (the panel lets the user change it).
DEFAULT_HEADROOM_FRAC = 0.05


@dataclass(frozen=True)
class Fit:
    dtype: str
    block_size: int
    bytes_per_token: int
    blocks: int  # whole blocks that fit
    tokens: int  # blocks * block_size


def kv_memory_available(memory_free: int, kv_pool_bytes: int, memory_total: int,
                        headroom_frac: float = DEFAULT_HEADROOM_FRAC) -> int:
    """Bytes a KV pool could take on this device, the weights already loaded.

    = free memory + the engine's current KV pool (rebuilding the pool releases it first)
      - headroom_frac x total memory (activations, allocator slack, other programs).
    Weights need no subtracting: they are in use, so they are not in memory_free. Never
    negative."""
    headroom = int(max(0.0, headroom_frac) * max(0, memory_total))
    return max(0, int(memory_free) + max(0, int(kv_pool_bytes)) - headroom)


def fit(available_bytes: int, shape: ModelShape, dtype: str, block_size: int) -> Fit:
    """How much of a paged pool fits in available_bytes: only whole blocks, so a bigger block
    size can hold fewer tokens (at most block_size - 1 fewer)."""
    per = bytes_per_token(shape, dtype)
    blocks = max(0, int(available_bytes)) // (block_size * per)
    return Fit(dtype, block_size, per, blocks, blocks * block_size)


def what_fits(available_bytes: int, shape: ModelShape,
              dtypes: tuple[str, ...] | list[str] = tuple(DTYPE_BYTES),
              block_sizes: tuple[int, ...] | list[int] = FIT_BLOCK_SIZES,
              ) -> dict[str, dict[int, Fit]]:
    """table[dtype][block_size] -> Fit, for every KV dtype and block size asked for."""
    return {d: {bs: fit(available_bytes, shape, d, bs) for bs in block_sizes} for d in dtypes}


def blocks_per_request(length: int, block_size: int) -> int:
    return -(-max(1, int(length)) // block_size)


def request_blocks(shape: ModelShape, length: int, block_size: int) -> int:
    """Blocks a request of `length` tokens holds: ceil(length / block_size), or for a model
    whose every layer slides a window W, no more than its window spans (kvmath)."""
    return sequence_blocks(shape, length, block_size)


def concurrent_requests(available_bytes: int, shape: ModelShape, dtype: str, block_size: int,
                        length: int) -> int:
    """Requests of `length` tokens (prompt + reply) that fit at once: each holds
    request_blocks whole blocks (no prefix sharing assumed)."""
    blocks = fit(available_bytes, shape, dtype, block_size).blocks
    return blocks // request_blocks(shape, length, block_size)
