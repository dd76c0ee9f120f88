"""int8 weights on the CPU: the native kernel (kernels/cpu_int8_gemm.c), its layout, and which
thread split runs it, measured per machine.

A weight is int8 codes in -127..127 with one float32 scale per 32 inputs of an output (GGUF's
Q8_0 blocks, engine.model.weight_formats.Int8Linear quantizes it). The kernel reads its own
layout, blocks of 16 outputs: codes [N / 16, K, 16], scales [N / 16, K / 32, 16] (`pack`).
Per output and group it sums x_k * code_k in input order, then adds the sum times the scale,
so a row's bits do not depend on the call's other rows or its thread split: the choice between
`native` (torch's threads) and `native-serial` (the calling thread) is speed alone, made per
weight shape, row bucket and thread count on first use (kernels.kernel_choice). Below
TOP_BUCKET rows (decode, speculative verify, small prompt pieces) there is no torch candidate:
a dequantized float matmul would round a row differently from one row count to the next. A
prefill chunk (TOP_BUCKET rows and more) also times torch's matmul on the dequantized weight,
whose blocked GEMM (AMX, AVX-512 BF16) wins once rows reuse each weight many times.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvscope.kernels import kernel_choice, native
from kvscope.kernels.cpu_linear import NATIVE, SERIAL, TOP_BUCKET, TORCH, bucket, bucket_label

BLOCK = 16  # outputs a block of the layout
GROUP = 32  # inputs sharing a scale
KINDS = {torch.float32: 0, torch.bfloat16: 1}


def supports(out_features: int, in_features: int) -> bool:
    return out_features % BLOCK == 0 and in_features % GROUP == 0 and native.available()


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (codes int8 [N, K] in -127..127, scales float32 [N, K / 32]):
    scale = max |w| of the group / 127, code = round(w / scale)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1) / 127).clamp_min(1e-12)
    codes = (groups / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale.contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [N, K] and scales [N, K / 32] in the kernel's blocks of 16 outputs."""
    n, k = codes.shape
    blocked = codes.reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()
    blocked_scales = scales.float().reshape(n // BLOCK, BLOCK, k // GROUP).transpose(1, 2)
    return blocked, blocked_scales.contiguous()


def dequantize(blocked: torch.Tensor, blocked_scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a packed int8 weight stands for: code * scale."""
    nb, k, _ = blocked.shape
    codes = blocked.transpose(1, 2).reshape(nb * BLOCK, k).float()
    scales = blocked_scales.transpose(1, 2).reshape(nb * BLOCK, k // GROUP)
    return (codes.reshape(nb * BLOCK, k // GROUP, GROUP) * scales[..., None]).reshape(-1, k)


def native_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                parallel: bool = True, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, contiguous) times the packed weight: [M, N] in x's
    dtype. lib: the kernels to run (default: the engine's build; the tests pass variants)."""
    m, k = x.shape
    n = codes.shape[0] * BLOCK
    if codes.shape[1] != k:
        raise ValueError(f"an int8 weight of {codes.shape[1]} inputs got rows of {k}")
    y = torch.empty((m, n), dtype=x.dtype)
    kind = KINDS[x.dtype]
    status = (lib or native.require_library()).kvscope_int8_gemm(
        y.data_ptr(), kind, x.data_ptr(), kind, codes.data_ptr(), scales.data_ptr(), m, n, k,
        int(parallel))
    if status:
        raise MemoryError("the CPU int8 matmul kernel could not allocate its scratch")
    return y


def implementation(rows: int, n: int, k: int) -> str | None:
    """The thread split already chosen for this call's key, or None (not yet measured)."""
    return kernel_choice.default().fast(_key(rows, n, k))


def _key(rows: int, n: int, k: int) -> tuple[object, ...]:
    return ("int8", n, k, bucket(rows), torch.get_num_threads())


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times the packed weight, [M, N] in x's dtype, on the
    thread split measured faster for this shape and row bucket (`supports` assumed)."""
    x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0] * BLOCK
    impl = implementation(m, n, k) or _choose(x, codes, scales)
    if impl == TORCH:
        return torch_int8(x, codes, scales)
    return native_int8(x, codes, scales, parallel=impl == NATIVE)


def _choose(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> str:
    m, k = x.shape
    n = codes.shape[0] * BLOCK
    info = {"op": "int8", "dtype": "int8", "shape": f"{n}x{k}", "rows": bucket_label(m),
            "threads": torch.get_num_threads()}
    return kernel_choice.default().choose(decision_name(m, n, k),
                                          candidates(x, codes, scales), info, _key(m, n, k))


def decision_name(rows: int, n: int, k: int) -> str:
    """The chooser's name for this call's decision (`kvscope bench --kernels` asks by it)."""
    threads = kernel_choice.threads_name(torch.get_num_threads())
    return f"int8 {n}x{k} rows{bucket_label(rows)} {threads}"


def candidates(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
               ) -> dict[str, Callable[[], object]]:
    """The implementations compared, each on x's first TOP_BUCKET rows: the thread splits,
    and from TOP_BUCKET rows up (a prefill chunk) torch's matmul of the dequantized weight."""
    rows = x[:TOP_BUCKET].contiguous()
    got: dict[str, Callable[[], object]] = {NATIVE: lambda: native_int8(rows, codes, scales)}
    if torch.get_num_threads() > 1:
        got[SERIAL] = lambda: native_int8(rows, codes, scales, parallel=False)
    if bucket(len(x)) == TOP_BUCKET:
        got[TORCH] = lambda: torch_int8(rows, codes, scales)
    return got


def torch_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's matmul (oneDNN: AMX or AVX-512 BF16 where the CPU has them) on the weight
    dequantized to bfloat16 for this call (kernels/cpu_int8_gemm.c, one pass), the rows
    rounded to bfloat16 as the int4 format rounds every row; [M, N] in x's dtype. Its
    rounding depends on the row count, so it is a candidate only for prefill chunks
    (TOP_BUCKET rows and more), never for the decode buckets, whose rows must round alike at
    every batch size; at those row counts the dequantization (one write of the weight) is
    small beside the multiply-adds."""
    n, k = codes.shape[0] * BLOCK, codes.shape[1]
    weight = torch.empty((n, k), dtype=torch.bfloat16)
    native.require_library().kvscope_int8_dequant_bf16(weight.data_ptr(), codes.data_ptr(),
                                                       scales.data_ptr(), n, k)
    return F.linear(x.to(torch.bfloat16), weight).to(x.dtype)
