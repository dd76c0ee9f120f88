"""Whether a fused decode step whose matmul choices include torch's runs as one region anyway.

Each matmul's implementation is chosen on its own (kernels/cpu_linear.py, cpu_int4.py), timed
call by call. The one-region step (engine/model/fused/one_region.py) runs native kernels only, so a
single torch choice sends the whole step kernel by kernel, where the threads wake again for
every kernel. A torch win by a hair then costs the step far more than it saved: at 16
bfloat16 sequences beside a prompt chunk (47 rows) on the AMX Xeon of 2026-12-06 torch took
the 576x1536 down projection by 0.02 ms (0.6 ms over 30 layers) and those steps went from 34
to 51 ms.

So that is decided for the whole step, measured as a matmul's choice is (kernels.kernel_choice:
on the step's own inputs, on first use, cached per machine): the one region with each torch
choice replaced by the fastest native variant measured beside it, against the kernel-by-kernel
step with torch's, per dtype, the model's matmul shapes, row bucket and threads. Both run the
same layers over the same pool; their KV writes put the step's own keys and values into the
step's own slots, so the candidates' repeats leave the pool as the chosen run does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvscope.engine.model.weight_formats import Linear
from kvscope.kernels import kernel_choice
from kvscope.kernels.cpu_linear import bucket, bucket_label

ONE_REGION, BY_KERNEL = "one-region", "kernel-by-kernel"


def one_region_wins(matmuls: Sequence[Linear], rows: int, io_dtype: torch.dtype,
                    run_one: Callable[[], object], run_by_kernel: Callable[[], object]) -> bool:
    """Whether this step runs as one region (native kernels in torch's place) rather than
    kernel by kernel with torch's matmuls: measured on first use of its decision."""
    threads = torch.get_num_threads()
    shapes = ",".join(f"{n}x{k}" for n, k in (m.shape for m in matmuls))
    dtype = str(io_dtype).removeprefix("torch.")
    fast_key = ("step", dtype, shapes, bucket(rows), threads)
    chooser = kernel_choice.default()
    got = chooser.fast(fast_key)
    if got is None:
        label = bucket_label(rows)
        info = {"op": "step", "dtype": dtype, "shape": shapes, "rows": label,
                "threads": threads}
        name = f"step {dtype} {shapes} rows{label} {kernel_choice.threads_name(threads)}"
        got = chooser.choose(name, {ONE_REGION: run_one, BY_KERNEL: run_by_kernel}, info,
                             fast_key)
    return got == ONE_REGION
