"""The model's matmul weights in a chosen format: dense, or weight-only int4 / int8 on CPU.

Decoding one token reads every weight once, so a CPU decode is bound by weight bytes: 4-bit
weights read 8x fewer bytes than float32. torch has a weight-only kernel for that on CPU,
`_weight_int4pack_mm_for_cpu` (asymmetric 4-bit in groups of 32 along the input dimension).
It wants bfloat16 activations and bfloat16 scales, so a 4-bit matmul rounds its input to
bfloat16 and returns the model's dtype. int8 has a native kernel of its own
(kernels/cpu_int8.py) that takes the rows as they are.

int4 is the format the embedded GGUF already has: its Q4_1 blocks are 32 weights sharing a
scale d and a minimum m (w = d * q + m, q in 0..15). Quantizing the dequantized weights again
in groups of 32 (min and max of the group) finds the same q, d and m, so int4 here adds no
error beyond rounding d and m to bfloat16. On a float checkpoint it is an ordinary lossy
4-bit quantization.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.engine.config import WEIGHT_FORMATS
from kvscope.kernels import cpu_int4, cpu_int8, cpu_linear, ops

INT4_GROUP = 32
# The packing kernel tiles output rows by 16.
INT4_ROW_MULTIPLE = 16
KERNEL_DTYPE = torch.bfloat16


class DenseLinear:
    """y = x W^T (+ b) in the model's dtype. On the CPU, decode-sized calls go through the
    native matmul (kernels.cpu_linear), which reads the same weight tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.native = ops.backend(weight.device) == "cpu" and cpu_linear.supports(weight)
        self.bias_f32 = None if bias is None or not self.native else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return cpu_linear.linear(x, self.weight, self.bias, self.bias_f32)
        return F.linear(x, self.weight, self.bias)

    @property
    def shape(self) -> tuple[int, int]:
        out_features, in_features = self.weight.shape
        return out_features, in_features

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]


class Int4Linear:
    """Weight-only 4-bit: w = (code - 8) * scale + zero, one (scale, zero) per 32 inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        codes, scale_zero = quantize_int4(weight.float())
        self.scale_zero = scale_zero.to(KERNEL_DTYPE)
        self.packed, self.tiles = int4_layout(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), self.scale_zero)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = int4_mm(x.reshape(-1, self.in_features), self)
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.tiles, self.scale_zero, self.bias)
                if t is not None]


class Int8Linear:
    """Weight-only int8 in groups of 32 (like GGUF's Q8_0): w = code * scale, code in
    -127..127, scale = max |w| of the group / 127 (float32).

    On the CPU's native kernels (kernels/cpu_int8_gemm.c) the codes are read in place, one
    fused multiply-add a weight, from float32 or bfloat16 rows without rounding them; the
    fused decode step takes these weights too. Without the native kernels (none built, or
    KVSCOPE_CPU_KERNELS=off) the weight is dequantized for each call and multiplied by torch:
    correct, and slow. (int8 had run as two 4-bit halves on the int4 kernel: twice its
    dequantization work for the same bytes, its input rounded to bfloat16, off the fused step.)
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        codes, scales = cpu_int8.quantize(weight)
        self.codes, self.scales = cpu_int8.pack(codes, scales)
        self.native = cpu_int8.supports(self.out_features, self.in_features)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.native and x.dtype in cpu_int8.KINDS:
            y = cpu_int8.int8_mm(rows, self.codes, self.scales)
        else:
            y = F.linear(rows.float(), cpu_int8.dequantize(self.codes, self.scales)).to(x.dtype)
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.bias) if t is not None]


# A matmul weight in any of the formats: called as linear(x), with .shape (out, in), .bias and
# .tensors().
Linear = DenseLinear | Int4Linear | Int8Linear


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (codes int32 [N, K] in 0..15, scale_zero float32 [K/32, N, 2]).

    Per group of 32 inputs: scale = (max - min) / 15, code = round((w - min) / scale), and
    the kernel's zero is the value of code 8, min + 8 * scale.
    """
    n, k = weight.shape
    groups = weight.reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    zero = lo + 8 * scale
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return codes.reshape(n, k).to(torch.int32), scale_zero


def int4_supports(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return k % INT4_GROUP == 0 and n % INT4_ROW_MULTIPLE == 0


def int4_layout(packed: torch.Tensor, scale_zero: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(torch's packed codes, None), or (None, the AMX tiles' layout) where this process runs
    the tiles' kernels (kernels.cpu_int4.family): one layout is kept, not both."""
    n, k = scale_zero.shape[1], scale_zero.shape[0] * INT4_GROUP
    if cpu_int4.supports(n, k) and cpu_int4.family() == cpu_int4.TILES:
        return None, cpu_int4.pack_tiles(packed, scale_zero)
    return packed, None


def int4_mm(x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
    """x [M, K] times the 4-bit weight, [M, N] in x's dtype, through bfloat16.

    Splitting a float32 x into two bfloat16 rows (head and remainder) was tried: greedy
    agreement with float32 Hugging Face rose only about 6 points (the bfloat16 scales bound
    it) for a slower call, so the input is simply rounded.
    """
    xb = x.to(KERNEL_DTYPE)
    return int4_mm_bf16(xb, linear).to(x.dtype)


def int4_mm_bf16(x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
    """bfloat16 x [M, K] times the 4-bit weight, [M, N] bfloat16, in its layout's kernels."""
    scale_zero = linear.scale_zero
    if linear.tiles is not None:
        return cpu_int4.tiles_mm(x, linear.tiles, scale_zero.shape[1])
    assert linear.packed is not None  # one of the two layouts is always kept
    if cpu_int4.supports(scale_zero.shape[1], x.shape[1]):
        return cpu_int4.int4_mm(x, linear.packed, scale_zero)
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(  # torch.ops is typed Any
        x, linear.packed, INT4_GROUP, scale_zero)
    return y


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> Linear:
    """The weight in `fmt` ('dense', 'int4' or 'int8'); dense for a shape the int4 kernel
    cannot tile (rows not a multiple of 16 or inputs not of 32)."""
    if fmt == "dense" or not int4_supports(weight):
        return DenseLinear(weight, bias)
    return Int4Linear(weight, bias) if fmt == "int4" else Int8Linear(weight, bias)


def check_weight_format(fmt: str, device: str) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights={fmt!r} is invalid: expected one of {WEIGHT_FORMATS}")
    if fmt in ("int4", "int8") and device != "cpu":
        raise ValueError(f"weights={fmt!r} runs on the CPU only (torch's weight-only kernels); "
                         f"on {device} use weights='dense'")


def int4_is_exact(weight: torch.Tensor, rel_tol: float = 1e-5) -> bool:
    """Whether the weight already holds 4-bit values in groups of 32 (a Q4_0/Q4_1 GGUF,
    dequantized): int4 then finds back the very same values."""
    if not int4_supports(weight):
        return False
    w = weight.float()
    codes, scale_zero = quantize_int4(w)
    return bool((dequantize_int4(codes, scale_zero) - w).abs().max()
                <= rel_tol * w.abs().max())


def dequantize_int4(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """The float weights [N, K] that (codes, scale_zero) stand for: (code - 8) * scale + zero."""
    n, k = codes.shape
    scale, zero = scale_zero.float().transpose(0, 1).unbind(-1)       # [N, K/32] each
    groups = (codes.reshape(n, k // INT4_GROUP, INT4_GROUP).float() - 8) * scale[..., None]
    return (groups + zero[..., None]).reshape(n, k)


def resolve_weights(fmt: str, device: str, state_dict: dict[str, torch.Tensor]) -> str:
    """'auto': int4 on the CPU when the checkpoint's matmul weights are 4-bit already (the
    embedded Q4_1 GGUF), where it adds no weight error (only bf16 rounding of scales and
    activations) and reads 8x fewer bytes per token; dense otherwise (a float checkpoint stays
    as exact as it came, and CUDA runs dense)."""
    check_weight_format(fmt, device)
    if fmt != "auto":
        return fmt
    if device != "cpu":
        return "dense"
    probe = next((w for name, w in state_dict.items()
                  # a dense MLP's, or a mixture of experts' first expert's (Qwen3-MoE, Mixtral)
                  if name.endswith(("mlp.down_proj.weight", "experts.0.down_proj.weight",
                                    "experts.0.w2.weight"))), None)
    return "int4" if probe is not None and int4_is_exact(probe) else "dense"
