"""KV quantization: per-token, per-KV-head dynamic scales (scale = max|x| / qmax).

One scale per (slot, kv_head) adapts to every token's own range, so an outlier token does not
flatten everybody else's resolution; it costs 4 bytes per head_dim values (6 % at head_dim 64).
"""
from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
# A token whose K/V are all zero still needs a finite, non-zero scale.
MIN_SCALE = 1e-8


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> (codes in dtype, scale [...] float32)."""
    x = x.float()
    # qmax as a tensor on x's device: torch on CUDA divides by a Python number as a multiply
    # by its reciprocal, which rounds 1 ulp off now and then, and the Triton write (IEEE
    # division) and the CPU would then disagree with this reference (seen on an H200).
    qmax = torch.tensor(QMAX[dtype], dtype=torch.float32, device=x.device)
    scale = (x.abs().amax(dim=-1) / qmax).clamp_min(MIN_SCALE)
    y = x / scale[..., None]
    if dtype == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448.0, 448.0).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]
