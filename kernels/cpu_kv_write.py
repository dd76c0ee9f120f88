"""The 1-byte KV write on the CPU (kernels/cpu_kv_write.c): shift and balance, rotation, absmax
scale and int8 or fp8 e4m3 codes for a step's new K and V rows in one native call each, where
the torch path (kernels.kv_write_ref after kernels.rotation / kernels.k_balance) runs a dozen
small ops per layer. Same result up to float32 summation order in the rotation (a code may
land one step away on a rounding boundary); without a rotation, bit for bit.
"""
from __future__ import annotations

import torch

from kvscope.kernels import native
from kvscope.kernels.k_balance import KBalanceLayer

MAX_HEAD_DIM = 1024
# The pool dtypes written here, numbered as kernels/cpu_kv_write.c numbers them.
KINDS = {torch.int8: 3, torch.float8_e4m3fn: 4}


def supports(key: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (key.device.type == "cpu" and k_cache.dtype in KINDS
            and k_cache.is_contiguous() and k_cache.shape[-1] <= MAX_HEAD_DIM
            and native.available())


def write_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    rotation: torch.Tensor | None = None,
                    k_balance: KBalanceLayer | None = None) -> None:
    """As kernels.ops.write_kv on an int8 or fp8 pool: key/value [T, kv_heads, head_dim]."""
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs its scale cache")
    slots = slot_mapping.to(torch.long).contiguous()
    r = None if rotation is None else rotation.float().contiguous()
    _write(key, slots, k_cache, k_scale, r, k_balance)
    _write(value, slots, v_cache, v_scale, r, None)


def _write(rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor,
           r: torch.Tensor | None, kb: KBalanceLayer | None) -> None:
    rows = rows.float().contiguous()
    num_rows, heads, d = rows.shape
    ptr = native.address
    native.require_library().kvscope_kv_write(
        rows.data_ptr(), num_rows, heads, d, slots.data_ptr(), cache.data_ptr(),
        scales.data_ptr(), ptr(r), ptr(kb.shift if kb else None), ptr(kb.gain if kb else None),
        KINDS[cache.dtype])
