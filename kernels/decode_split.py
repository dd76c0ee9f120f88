"""Whether one kernel-by-kernel decode attention call (kernels/cpu_attention.py) is shared over
torch's threads or runs on the calling thread, decided by measurement (kernels.kernel_choice).

A parallel region pays a thread wake-up; below a few thousand cached rows that costs more
than the split saves, and where the line lies depends on the CPU, its memory and how idle
threads wait (docs/threads.md). The decision is per pool dtype, bucket of cached rows times
KV heads (powers of two from MIN_BUCKET to TOP_BUCKET, which stands for every larger call)
and thread count, timed on the call's own inputs: both candidates write the same output,
bit for bit (the split never changes a row's arithmetic). The one-region decode step
(kernels/cpu_decode_step.c) shares the attention over its team anyway and does not ask.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvscope.kernels import kernel_choice

PARALLEL, SERIAL = "native", "native-serial"
MIN_BUCKET, TOP_BUCKET = 256, 65536


def bucket(cached_rows: int) -> int:
    """The bucket a call with this many cached rows (times KV heads) is decided in."""
    return min(max(1 << max(cached_rows - 1, 0).bit_length(), MIN_BUCKET), TOP_BUCKET)


def bucket_label(cached_rows: int) -> str:
    b = bucket(cached_rows)
    return f"{b}+" if b == TOP_BUCKET else f"<={b}"


def decision_name(pool_dtype: str, cached_rows: int) -> str:
    threads = kernel_choice.threads_name(torch.get_num_threads())
    return f"decode-attention {pool_dtype} rows{bucket_label(cached_rows)} {threads}"


def parallel(call: Callable[[int], None], pool_dtype: str, cached_rows: int) -> int:
    """1 (share the call over torch's threads) or 0 (the calling thread), as measured for this
    call's bucket; `call(parallel)` runs the kernel (a measurement runs it both ways)."""
    threads = torch.get_num_threads()
    if threads < 2:
        return 0
    key = ("decode-attention", pool_dtype, bucket(cached_rows), threads)
    chooser = kernel_choice.default()
    choice = chooser.fast(key)
    if choice is None:
        info = {"op": "attn", "dtype": f"{pool_dtype}", "shape": "decode",
                "rows": bucket_label(cached_rows), "threads": threads}
        choice = chooser.choose(decision_name(pool_dtype, cached_rows),
                                {PARALLEL: lambda: call(1), SERIAL: lambda: call(0)}, info, key)
    return 1 if choice == PARALLEL else 0
