"""The KV pool: per layer K and V of [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.kv_cache import memory as kv_memory
from kvscope.engine.kv_cache.anchors import AnchorTable
from kvscope.engine.model.paged_decoder import LayerKV, ModelShape
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.quant import SCALE_DTYPE, is_quantized
from kvscope.kernels.rotation import rotation_matrix


def kv_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """K and V, every layer: 2 x layers x kv_heads x (head_dim x bytes [+ one float scale])."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    scale = torch.empty(0, dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    return 2 * shape.num_layers * shape.num_kv_heads * (shape.head_dim * itemsize + scale)


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    return budget_bytes // (block_size * bytes_per_token)


def pool_bytes(shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
               anchor_tokens: int = 0) -> int:
    """What KVPool.allocate(shape, num_blocks, block_size, dtype, ...) takes: the pool (scale
    caches included) and, for 1-byte dtypes, its anchor table."""
    total = num_blocks * block_size * kv_bytes_per_token(shape, dtype)
    if is_quantized(dtype) and anchor_tokens > 0:
        total += (2 * shape.num_layers * AnchorTable(anchor_tokens).num_entries * anchor_tokens
                  * shape.num_kv_heads * shape.head_dim * 4)  # float32 k and v
    return total


@dataclass
class KVPool:
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Per layer (k_scale, v_scale) of [num_blocks, block_size, kv_heads] for int8/fp8 pools.
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    bytes_per_token: int
    # R [head_dim, head_dim] float32 when the pool holds rotated K/V (kernels.rotation).
    rotation: torch.Tensor | None = None
    # Per layer the exact K shift and q/k balance (kernels.k_balance) the pool's keys carry;
    # None when they are plain. Calibrated once per model (engine.kv_cache.calibration).
    k_balance: list[KBalanceLayer] | None = None
    # Per layer (k, v) of [entries, anchor tokens, kv_heads, head_dim] float32: the exact
    # first positions of each opening (engine.kv_cache.anchors), in the pool's rotated and balanced
    # space; None when the pool keeps no anchors (wide dtypes, or anchors off).
    anchors: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    anchor_table: AnchorTable | None = None

    @classmethod
    def allocate(cls, shape: ModelShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str, rotation: str = "none",
                 k_balance: list[KBalanceLayer] | None = None,
                 anchor_tokens: int = 0) -> KVPool:
        """rotation: "calibrated" (Hadamard + `k_balance`, the calibrated per-layer K
        transform), "hadamard" or "none" (kernels.rotation). anchor_tokens: how many first
        positions of each opening a 1-byte pool keeps exact (engine.kv_cache.anchors); 0: none."""
        if (rotation == "calibrated") != (k_balance is not None):
            raise ValueError("a 'calibrated' pool needs its K balance, and only it takes one")
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        def zeros(size: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return kv_memory.zeros(size, dt, device)  # memory a rebuild gives back (kv_memory)

        caches = [(zeros(dims, dtype), zeros(dims, dtype)) for _ in range(shape.num_layers)]
        scales = None
        if is_quantized(dtype):
            scales = [(zeros(dims[:3], SCALE_DTYPE), zeros(dims[:3], SCALE_DTYPE))
                      for _ in range(shape.num_layers)]
        anchors = table = None
        if scales is not None and anchor_tokens > 0:
            table = AnchorTable(anchor_tokens)
            adims = (table.num_entries, anchor_tokens, shape.num_kv_heads, shape.head_dim)
            anchors = [(zeros(adims, torch.float32), zeros(adims, torch.float32))
                       for _ in range(shape.num_layers)]
        return cls(caches, scales, num_blocks, block_size, dtype,
                   kv_bytes_per_token(shape, dtype),
                   rotation_matrix("none" if rotation == "none" else "hadamard",
                                   shape.head_dim, device),
                   [kb.to(device) for kb in k_balance] if k_balance is not None else None,
                   anchors, table)

    def layer(self, i: int) -> LayerKV:
        """(k_cache, v_cache, k_scale, v_scale, k_balance, anchors) of layer i; scales are
        None unless quantized, k_balance None unless the keys are balanced, anchors (k, v)
        None unless the pool keeps anchor tokens."""
        k, v = self.caches[i]
        ks, vs = self.scales[i] if self.scales else (None, None)
        return (k, v, ks, vs, self.k_balance[i] if self.k_balance is not None else None,
                self.anchors[i] if self.anchors is not None else None)

    @property
    def nbytes(self) -> int:
        """Every byte of the pool, scale caches included."""
        total = sum(k.nbytes + v.nbytes for k, v in self.caches)
        return total + sum(k.nbytes + v.nbytes for k, v in self.scales or [])

    @property
    def anchor_nbytes(self) -> int:
        """The anchor table's bytes: fixed, whatever the number of blocks or tokens."""
        return sum(k.nbytes + v.nbytes for k, v in self.anchors or [])
