"""Dense y = x W^T (+ b) on the CPU: the native kernel (kernels/cpu_small_gemm.c) where it
measured faster than torch, torch's matmul elsewhere.

Measured here, the whole SmolLM2 matmul set per step (2 threads, same process, torch vs
native): float32 at 16 rows 98.7 vs 29.1 ms, at 32 rows 110.6 vs 49.1 ms, at 64 rows 84.2 vs
98.5 ms (torch's blocked GEMM wins once there are enough rows to reuse each weight); bfloat16
at 16 rows 88.3 vs 37.9 ms and at 256 rows 1146 vs 551 ms (torch converts bfloat16 on every
call on a CPU without bf16 instructions). So float32 takes the kernel up to 32 rows, bfloat16
always.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.kernels import native

KINDS = {torch.float32: 0, torch.bfloat16: 1}
MAX_ROWS = {torch.float32: 32, torch.bfloat16: None}


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can take this weight ([N, K], K a multiple of 16, on the CPU)."""
    return (weight.device.type == "cpu" and weight.dtype in KINDS and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] % 16 == 0 and native.available())


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call goes through the kernel (`supports(weight)` assumed)."""
    limit = MAX_ROWS[weight.dtype]
    return x.dtype == weight.dtype and (limit is None or x.numel() <= limit * weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           bias_f32: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel when `takes(x, weight)`. `bias_f32` is
    the bias as contiguous float32 (what the kernel reads), kept by the caller."""
    if not takes(x, weight):
        return F.linear(x, weight, bias)
    return native_linear(x, weight, bias_f32)


def native_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) through the kernel whatever the row count (`supports(weight)` assumed, x in
    the weight's dtype)."""
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty((rows.shape[0], n), dtype=x.dtype)
    kind = KINDS[x.dtype]
    status = native.require_library().kvscope_gemm(
        y.data_ptr(), kind, rows.data_ptr(), kind, weight.data_ptr(), kind,
        native.address(bias_f32), rows.shape[0], n, k)
    if status:
        raise MemoryError("the CPU matmul kernel could not allocate its scratch")
    return y.view(*x.shape[:-1], n)
