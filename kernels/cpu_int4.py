"""4-bit weights on the CPU through the native kernel (kernels/cpu_int4_gemm.c), reading the
very tensors torch's `_weight_int4pack_mm_for_cpu` takes and giving its bits.

Both compute the same chain for every output (bfloat16 input, each weight (code - 8) *
scale + zero from a bfloat16 scale and zero per 32 inputs, float32 sums in input order,
bfloat16 output), so the choice between them is speed alone, measured per weight shape, row
bucket and thread count on first use (kernels.kernel_choice). torch's kernel pays the
dequantization again every few rows and the native one shares it over up to 12, so the
native one tends to win at the 2-16 rows of a batched decode or a speculative verify and
torch's at one row; which, where, is this machine's measurement.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvscope.kernels import kernel_choice, native
from kvscope.kernels.cpu_linear import SERIAL, TOP_BUCKET, TORCH, bucket, bucket_label

NATIVE = "native"
GROUP = 32
BLOCK = 64  # torch's CPU packing tiles the outputs by 64 (kernels/cpu_int4_gemm.c)
KINDS = {torch.float32: 0, torch.bfloat16: 1}


def supports(out_features: int, in_features: int) -> bool:
    return out_features % BLOCK == 0 and in_features % GROUP == 0 and native.available()


def torch_int4(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """torch's kernel: x [M, K] bfloat16, [M, N] bfloat16."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(  # torch.ops is typed Any
        x, packed, GROUP, scale_zero)
    return y


def native_int4(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor,
                parallel: bool = True) -> torch.Tensor:
    """The native kernel on the same tensors: x [M, K] (float32 or bfloat16, contiguous),
    [M, N] bfloat16."""
    m, k = x.shape
    n = scale_zero.shape[1]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    status = native.require_library().kvscope_int4_gemm(
        y.data_ptr(), KINDS[torch.bfloat16], x.data_ptr(), KINDS[x.dtype], packed.data_ptr(),
        scale_zero.data_ptr(), m, n, k, int(parallel))
    if status:
        raise MemoryError("the CPU int4 matmul kernel could not allocate its scratch")
    return y


def implementation(rows: int, n: int, k: int) -> str | None:
    """The implementation already chosen for this call's key, or None (not yet measured)."""
    return kernel_choice.default().fast(_key(rows, n, k))


def _key(rows: int, n: int, k: int) -> tuple[object, ...]:
    return ("int4", n, k, bucket(rows), torch.get_num_threads())


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 times the packed weight, [M, N] bfloat16, through whichever
    implementation measured faster for this shape and row bucket (`supports` assumed)."""
    m, k = x.shape
    n = scale_zero.shape[1]
    impl = implementation(m, n, k) or _choose(x, packed, scale_zero)
    if impl == TORCH:
        return torch_int4(x, packed, scale_zero)
    return native_int4(x.contiguous(), packed, scale_zero, parallel=impl == NATIVE)


def _choose(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> str:
    m, k = x.shape
    n = scale_zero.shape[1]
    info = {"op": "int4", "dtype": "int4", "shape": f"{n}x{k}", "rows": bucket_label(m),
            "threads": torch.get_num_threads()}
    return kernel_choice.default().choose(decision_name(m, n, k),
                                          candidates(x, packed, scale_zero), info, _key(m, n, k))


def decision_name(rows: int, n: int, k: int) -> str:
    """The chooser's name for this call's decision (`kvscope bench --kernels` asks by it)."""
    threads = kernel_choice.threads_name(torch.get_num_threads())
    return f"int4 {n}x{k} rows{bucket_label(rows)} {threads}"


def candidates(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
               ) -> dict[str, Callable[[], object]]:
    """The implementations compared, each on x's first TOP_BUCKET rows."""
    rows = x[:TOP_BUCKET].contiguous()
    got: dict[str, Callable[[], object]] = {
        NATIVE: lambda: native_int4(rows, packed, scale_zero),
        TORCH: lambda: torch_int4(rows, packed, scale_zero)}
    if torch.get_num_threads() > 1:
        got[SERIAL] = lambda: native_int4(rows, packed, scale_zero, parallel=False)
    return got
