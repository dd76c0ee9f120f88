"""Paged decode attention's speed on the GPU: time per call, the bytes it must read, and the
achieved bandwidth as a share of a device-to-device copy measured in the same run."""
from __future__ import annotations

import math
from collections.abc import Callable

from benchmarks.device.gpu_kernels import torch_dtype
from kvscope.engine.measure.timing import is_cuda, median_of


def bench_ms(fn: Callable[[], object], device: object = "cuda") -> float:
    """Median milliseconds: on CUDA triton.testing.do_bench (warm-up, L2 flushed between
    runs); elsewhere (dry runs of this script's code) a plain wall-clock median of 3."""
    if is_cuda(device):
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    return median_of(fn, 3, device=device) * 1e3


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    import torch

    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * n / (ms * 1e-3)


def decode_pool(kv_dtype, num_blocks, block_size, kv_heads, head_dim, device):
    """A filled pool (random codes/values, positive scales) without the poison pass."""
    import torch

    from kvscope.kernels.quant import is_quantized

    shape = (num_blocks, block_size, kv_heads, head_dim)

    def cache():
        if kv_dtype == torch.int8:
            return torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        if kv_dtype == torch.float8_e4m3fn:
            b = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device)  # no NaN byte
            b |= torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7
            return b.view(kv_dtype)
        return torch.randn(shape, dtype=kv_dtype, device=device)

    def scales():
        if not is_quantized(kv_dtype):
            return None
        return torch.rand(shape[:3], device=device) * 0.02 + 1e-3

    return cache(), cache(), scales(), scales()


def time_decode(name, heads, kv_heads, head_dim, kv_name, batch, ctx, block_size, device,
                copy_bw, with_ref: bool) -> dict:
    import torch

    from kvscope.kernels.attention_ref import (
        AttentionMetadata,
        group_decode_rows,
        paged_attention_ref,
    )
    from kvscope.kernels.quant import is_quantized
    from kvscope.kernels.triton_attention import _choose_splits, paged_attention_triton

    kv_dtype = torch_dtype(kv_name)
    per_seq = ctx // block_size
    num_blocks = batch * per_seq + 1
    pool = decode_pool(kv_dtype, num_blocks, block_size, kv_heads, head_dim, device)
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, per_seq)
    starts = list(range(batch + 1))
    ctx_lens = [ctx] * batch
    meta = AttentionMetadata(starts, ctx_lens, tables, torch.zeros(0, dtype=torch.long,
                                                                   device=device),
                             group_decode_rows(starts, ctx_lens), [])
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(head_dim)
    ms = bench_ms(lambda: paged_attention_triton(q, pool[0], pool[1], meta, scale, pool[2],
                                                 pool[3], out=out), device)
    ms_rotated = ms_balanced = None
    if kv_name == "int8":  # the fused q / output rotation (kernels/rotation.py), same pool
        from kvscope.kernels.rotation import rotation_matrix

        r = rotation_matrix("hadamard", head_dim, device)
        ms_rotated = bench_ms(lambda: paged_attention_triton(q, pool[0], pool[1], meta, scale,
                                                             pool[2], pool[3], out=out,
                                                             rotation=r), device)
        from kvscope.kernels.k_balance import KBalanceLayer

        kb = KBalanceLayer.of(torch.zeros(kv_heads, head_dim),
                              torch.ones(kv_heads, head_dim)).to(device)
        ms_balanced = bench_ms(lambda: paged_attention_triton(q, pool[0], pool[1], meta,
                                                              scale, pool[2], pool[3], out=out,
                                                              rotation=r, k_balance=kb), device)
    elem = pool[0].element_size()
    kv_bytes = batch * ctx * kv_heads * head_dim * elem * 2
    scale_bytes = batch * ctx * kv_heads * 4 * 2 if is_quantized(kv_dtype) else 0
    total = kv_bytes + scale_bytes + tables.numel() * 8 + 2 * q.numel() * q.element_size()
    bw = total / (ms * 1e-3)
    row = {"config": name, "kv_dtype": kv_name, "batch": batch, "context": ctx,
           "block_size": block_size, "num_splits": _choose_splits(q.device, batch * kv_heads,
                                                                  ctx),
           "ms": ms, "bytes_read": total, "gb_per_s": bw / 1e9, "share_of_copy_bw": bw / copy_bw,
           "ref_ms": None, "ms_rotated": ms_rotated, "ms_calibrated": ms_balanced}
    if with_ref:
        try:
            row["ref_ms"] = bench_ms(lambda: paged_attention_ref(q, pool[0], pool[1], meta,
                                                                 scale, pool[2], pool[3]),
                                     device)
        except torch.OutOfMemoryError:
            row["ref_ms"] = "out of memory"
    return row
