"""Dense y = x W^T (+ b) on the CPU: the native kernel (kernels/cpu_small_gemm.c, on torch's
threads or on the calling one) or torch's matmul (oneDNN), whichever measured faster on this
machine for this weight, dtype, row bucket and thread count (kernels.kernel_choice).

Why measured rather than fixed: the winner moves with the CPU. On a Xeon without bf16
instructions the kernel won bfloat16 at every row count (torch converted bfloat16 on every
call) and float32 up to 32 rows; on a CPU with AVX-512 BF16 torch's bfloat16 matmul uses
bf16 dot products and won from a few rows up, until the kernel took bfloat16 weights on the
same hardware (kernels/cpu_amx_gemm.c on AMX tiles, kernels/cpu_dpbf16_gemm.c on AVX-512 BF16
dot products): then it won every bucket below 64 rows on the AMX Xeon, except one row, where
the kernel a path down, without the tiles, won (the VEC candidates). Rows are bucketed by
powers of two up to TOP_BUCKET; above it both run at their compute peak and their times grow
in step with the rows, so that bucket is measured on its first TOP_BUCKET rows.

float32 below TOP_BUCKET chooses between the two native variants only. They give every row
the same bits whatever else is in the call, and each other's bits; torch's matmul does not
(oneDNN blocks by the row count, so a row's float32 rounding depends on how many rows came
with it). A decode row then rounds the same in a batch of 1 or 16, and a speculative
verify's rows as the plain decodes of the same positions, so a near tie cannot flip a greedy
token with the load (tests/kernels/test_cpu_linear.py). Where torch won those buckets it won
by little on float32 (its AVX-512 FMA is what the kernel uses too); bfloat16 keeps torch as
a candidate (on a CPU with neither AMX nor AVX-512 BF16 the kernel widens bfloat16 to
float32, and torch may win there), and so do long prefill chunks, whose rows are many anyway.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvscope.kernels import kernel_choice, native

KINDS = {torch.float32: 0, torch.bfloat16: 1}
NATIVE, SERIAL, TORCH = "native", "native-serial", "torch"
# bfloat16: the kernel one hardware path below the best the CPU has for the weight (below AMX
# tiles the AVX-512 BF16 dot products, below those float32 widening), on torch's threads or
# the calling one. The tiles win from a few rows up, but one row is memory-bound, and there
# their 16-row reads lost (0.139 against 0.093 ms for 3072x576 on the AMX Xeon of
# 2026-12-06); the dot products against widening was never measured on a CPU without AMX.
# So which runs is measured like the rest.
VEC, VEC_SERIAL = "native-vec", "native-vec-serial"
AMX, DOT = 1, 2  # kernels/cpu_team.h KVSCOPE_BF16_*: the hardware paths a call may take
NATIVES = (NATIVE, SERIAL, VEC, VEC_SERIAL)
PARALLEL = (NATIVE, VEC)
TOP_BUCKET = 256


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can take this weight ([N, K], K a multiple of 16, on the CPU)."""
    return (weight.device.type == "cpu" and weight.dtype in KINDS and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] % 16 == 0 and native.available())


def bucket(rows: int) -> int:
    """The row bucket a call of `rows` rows is decided in: the next power of two, at most
    TOP_BUCKET (which stands for every larger count too)."""
    return min(1 << max(rows - 1, 0).bit_length(), TOP_BUCKET)


def bucket_label(rows: int) -> str:
    """How decisions and tables name the bucket of `rows` rows: "<=16", "256+"."""
    top = bucket(rows)
    return f"{top}+" if top == TOP_BUCKET else f"<={top}"


def implementation(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which implementation runs x W^T (`supports(weight)` assumed): NATIVE, SERIAL or TORCH,
    measured on first use of this (dtype, weight shape, row bucket, threads)."""
    if x.dtype != weight.dtype:
        return TORCH
    n, k = weight.shape
    rows = x.numel() // k
    threads = torch.get_num_threads()
    fast_key = _key(weight.dtype, n, k, rows)
    chooser = kernel_choice.default()
    got = chooser.fast(fast_key)
    if got is not None:
        return got
    dtype = str(weight.dtype).removeprefix("torch.")
    info = {"op": "linear", "dtype": dtype, "shape": f"{n}x{k}", "rows": bucket_label(rows),
            "threads": threads}
    return chooser.choose(decision_name(weight.dtype, n, k, rows), candidates(x, weight), info,
                          fast_key)


def decision_name(dtype: torch.dtype, n: int, k: int, rows: int) -> str:
    """The chooser's name for the decision a call of `rows` rows is made in."""
    threads = kernel_choice.threads_name(torch.get_num_threads())
    dtype_name = str(dtype).removeprefix("torch.")
    return f"linear {dtype_name} {n}x{k} rows{bucket_label(rows)} {threads}"


def best_native(dtype: torch.dtype, n: int, k: int, rows: int) -> str | None:
    """The fastest native variant measured in this call's decision (whichever won it), or
    None where the decision holds no native time."""
    got = kernel_choice.default().decisions.get(decision_name(dtype, n, k, rows))
    times = {name: t for name, t in (got.times_ms if got else {}).items() if name in NATIVES}
    return min(times, key=lambda name: times[name]) if times else None


def chosen(dtype: torch.dtype, n: int, k: int, rows: int) -> str | None:
    """The implementation already chosen for x W^T with W [n, k] of `dtype` and `rows` input
    rows, or None (not measured yet)."""
    return kernel_choice.default().fast(_key(dtype, n, k, rows))


def _key(dtype: torch.dtype, n: int, k: int, rows: int) -> tuple[object, ...]:
    return ("linear", dtype, n, k, bucket(rows), torch.get_num_threads())


def row_invariant_only(dtype: torch.dtype, rows: int) -> bool:
    """Whether a call of `rows` rows chooses among the row-invariant native variants only."""
    return dtype == torch.float32 and bucket(rows) < TOP_BUCKET


def candidates(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The implementations compared, each on x's first TOP_BUCKET rows (the serial kernel
    only where there is more than one thread to compare with; torch's matmul not for
    float32 below TOP_BUCKET rows, row_invariant_only; the kernel a hardware path down where
    a bfloat16 weight has one, has_vec)."""
    rows = x.reshape(-1, weight.shape[1])[:TOP_BUCKET].contiguous()
    serial = torch.get_num_threads() > 1
    names = [NATIVE, SERIAL] if serial else [NATIVE]
    if has_vec(weight):
        names += [VEC, VEC_SERIAL] if serial else [VEC]
    n, k = weight.shape
    got: dict[str, Callable[[], object]] = {
        name: functools.partial(native_linear, rows, weight, None, name in PARALLEL,
                                paths(name, n, k)) for name in names}
    if not row_invariant_only(weight.dtype, len(rows)):
        got[TORCH] = lambda: F.linear(rows, weight)
    return got


def amx_applies(weight: torch.Tensor) -> bool:
    """Whether the kernel would take this bfloat16 weight on AMX tiles (built with them,
    granted by the OS, N % 16 == 0 and K % 32 == 0)."""
    return weight.dtype == torch.bfloat16 and _amx_fits(*weight.shape)


def has_vec(weight: torch.Tensor) -> bool:
    """Whether a bfloat16 weight has a hardware path above plain widening here (AMX tiles or
    AVX-512 BF16 dot products), so the VEC candidates differ from the native ones."""
    if weight.dtype != torch.bfloat16:
        return False
    n, k = weight.shape
    return _amx_fits(n, k) or bool(native.require_library().kvscope_dpbf16_fits(k))


def paths(impl: str, n: int, k: int) -> int:
    """The hardware paths a native implementation lets an [n, k] bfloat16 weight take (the
    kernel takes the best of them the CPU and shape allow): every one, or for VEC the ones
    below the best (the dot products where the tiles apply, else widening)."""
    if impl not in (VEC, VEC_SERIAL):
        return AMX | DOT
    return DOT if _amx_fits(n, k) else 0


@functools.cache
def _amx_fits(n: int, k: int) -> bool:
    # fixed for the process (the CPU, the OS's grant, the shape): asked once per shape, not
    # on every matmul of a step
    return bool(native.require_library().kvscope_amx_fits(n, k))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           bias_f32: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through the implementation chosen for this call's shape.
    `bias_f32` is the bias as contiguous float32 (what the kernel reads), kept by the
    caller."""
    impl = implementation(x, weight)
    if impl == TORCH:
        return F.linear(x, weight, bias)
    return native_linear(x, weight, bias_f32, parallel=impl in PARALLEL,
                         paths=paths(impl, *weight.shape))


def native_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias_f32: torch.Tensor | None = None, parallel: bool = True,
                  paths: int = AMX | DOT) -> torch.Tensor:
    """x W^T (+ b) through the kernel whatever the row count (`supports(weight)` assumed, x in
    the weight's dtype); parallel: on torch's threads, else on the calling one; paths: the
    hardware paths a bfloat16 weight may take (AMX, DOT)."""
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty((rows.shape[0], n), dtype=x.dtype)
    kind = KINDS[x.dtype]
    status = native.require_library().kvscope_gemm(
        y.data_ptr(), kind, rows.data_ptr(), kind, weight.data_ptr(), kind,
        native.address(bias_f32), rows.shape[0], n, k, int(parallel), paths)
    if status:
        raise MemoryError("the CPU matmul kernel could not allocate its scratch")
    return y.view(*x.shape[:-1], n)
