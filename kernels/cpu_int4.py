"""4-bit weights on the CPU: two families of kernels, one per process.

- "fma": the native FMA kernel (kernels/cpu_int4_gemm.c) and torch's
  `_weight_int4pack_mm_for_cpu`, on torch's packed tensors. Both compute the same chain for
  every output (bfloat16 input, each weight (code - 8) * scale + zero from a bfloat16 scale
  and zero per 32 inputs, float32 sums in input order, bfloat16 output), so the choice
  between them is speed alone, measured per weight shape, row bucket and thread count on
  first use (kernels.kernel_choice). torch's kernel pays the dequantization again every few
  rows and the native one shares it over up to 12.
- "tiles": the AMX kernel (kernels/cpu_int4_tiles.c) on its own layout of the same bytes.
  Its sums round unlike the FMA chain's (last bits of some outputs), so it runs at every row
  count or not at all: a speculative verify's rows must round as the plain decodes of the
  same positions do. From a few rows up it is 1.5-3.5x the FMA kernel's speed; at one row
  about even.

family() decides once per process: KVSCOPE_INT4_KERNELS=fma|tiles, else measured per machine
(tiles_pay: the tiles where one row costs at most ONE_ROW_SLACK x the FMA kernel's, and a
verify's rows less), else "fma" where there are no tiles.
"""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch

from kvscope.kernels import kernel_choice, native
from kvscope.kernels.cpu_linear import SERIAL, TOP_BUCKET, TORCH, bucket, bucket_label

NATIVE = "native"
GROUP = 32
BLOCK = 64  # the weights the native kernels take: out_features a multiple of this
# torch's CPU packing tiles the outputs by the vector width its kernel was dispatched to:
# 64 under AVX-512, 32 under AVX2 (kernels/cpu_int4_gemm.c reads both)
TORCH_BLOCKS = (64, 32)
KINDS = {torch.float32: 0, torch.bfloat16: 1}


def supports(out_features: int, in_features: int) -> bool:
    return (out_features % BLOCK == 0 and in_features % GROUP == 0 and native.available()
            and torch_block() is not None)


@functools.cache
def torch_block() -> int | None:
    """The width of torch's packing in this process (fixed by the CPU, or ATEN_CPU_CAPABILITY),
    read off a packed probe: one of TORCH_BLOCKS, or None for a layout the native kernels
    do not read (then torch's kernel runs alone). A kernel that assumed 64 computed another
    weight's product on an AVX2-only CPU."""
    n, k = 2 * BLOCK, GROUP
    codes = (torch.arange(n * k, dtype=torch.int32).reshape(n, k) * 7 + 3) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).flatten()
    for block in TORCH_BLOCKS:
        if torch.equal(packed, pack_reference(codes, block)):
            return block
    return None


def pack_reference(codes: torch.Tensor, block: int) -> torch.Tensor:
    """codes [N, K] (0..15) in blocks of `block` outputs, flat: [N / block, K, block / 2]
    bytes, byte j of input k holding output j (low nibble) and j + block / 2 (high)."""
    n, k = codes.shape
    tiled = codes.reshape(n // block, 2, block // 2, k).permute(0, 3, 1, 2)
    return (tiled[:, :, 0] | (tiled[:, :, 1] << 4)).to(torch.uint8).flatten()


def torch_int4(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """torch's kernel: x [M, K] bfloat16, [M, N] bfloat16."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(  # torch.ops is typed Any
        x, packed, GROUP, scale_zero)
    return y


def native_int4(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor,
                parallel: bool = True, block: int | None = None,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The native kernel on the same tensors: x [M, K] (float32 or bfloat16, contiguous),
    [M, N] bfloat16; block: the packing's width (default: torch's here, torch_block());
    lib: the kernels to run (default: the engine's build; the tests pass other instruction
    sets' builds, kernels.native.variant)."""
    block = block or torch_block()
    if block not in TORCH_BLOCKS:  # it would read the codes as another weight's
        raise ValueError("torch packs int4 weights in a layout the native kernel does not "
                         f"read here (blocks of {TORCH_BLOCKS}): use torch_int4")
    m, k = x.shape
    n = scale_zero.shape[1]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    status = (lib or native.require_library()).kvscope_int4_gemm(
        y.data_ptr(), KINDS[torch.bfloat16], x.data_ptr(), KINDS[x.dtype], packed.data_ptr(),
        scale_zero.data_ptr(), m, n, k, int(parallel), block)
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


# -- the AMX tiles' kernels (kernels/cpu_int4_tiles.c) ---------------------------------------
# Their sums round unlike the FMA chain's, so one family runs every row count (a speculative
# verify's rows must round as the plain decodes of the same positions): "fma" (the native FMA
# kernel and torch's, which give the same bits) or "tiles". KVSCOPE_INT4_KERNELS=fma|tiles
# decides it; otherwise it is measured once per machine (family()).
FMA, TILES = "fma", "tiles"
FAMILY_ENV = "KVSCOPE_INT4_KERNELS"
BLOCK_GROUP_BYTES = 1280  # per 64 outputs and 32 inputs: 1024 bytes of codes, 256 of scales
# The tiles are taken only when a single row (one chat's decode) costs at most this much more
# than on the FMA kernel, and a speculative verify's rows (SAMPLE_ROWS[1]) less.
ONE_ROW_SLACK = 1.03
SAMPLE_SHAPE = (1536, 576)  # SmolLM2's gate/up projection: a small model's typical matmul
SAMPLE_ROWS = (1, 5)
# A decode step reads weights that are not in the core's caches: the sample cycles through
# more bytes than two cores' L2 (12 x 0.65 MB here) rather than timing one hot weight.
SAMPLE_WEIGHTS = 12
_family: str | None = None


def tiles_ready() -> bool:
    """Built with AMX, the kernel granted the tiles to this process, and torch packs by 64
    (the tiles' layout is made from that one)."""
    lib = native.library()
    return (lib is not None and bool(lib.kvscope_int4_tiles_ready())
            and torch_block() == BLOCK)


def pack_tiles(packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """torch's packed codes and scale_zero in the tiles' layout (the same bytes, reordered)."""
    n, k = scale_zero.shape[1], scale_zero.shape[0] * GROUP
    out = torch.empty(n // BLOCK * (k // GROUP) * BLOCK_GROUP_BYTES, dtype=torch.uint8)
    native.require_library().kvscope_int4_tiles_pack(
        out.data_ptr(), packed.contiguous().data_ptr(), scale_zero.contiguous().data_ptr(), n, k)
    return out


def tiles_mm(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, rounded to bfloat16) times the weight in the tiles'
    layout, [M, n] bfloat16."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty((m, n), dtype=torch.bfloat16)
    status = native.require_library().kvscope_int4_tiles_gemm(
        y.data_ptr(), KINDS[torch.bfloat16], x.data_ptr(), KINDS[x.dtype], tiles.data_ptr(),
        m, n, k, 1)
    if status:
        raise MemoryError("the CPU int4 tiles kernel could not allocate its scratch"
                          if status == 1 else "the CPU int4 tiles kernel has no AMX here")
    return y


def family() -> str:
    """Which int4 kernels this process runs: fixed for its life (bits must not change under a
    running engine)."""
    global _family
    if _family is None:
        _family = _decide_family()
    return _family


def _decide_family() -> str:
    forced = os.environ.get(FAMILY_ENV)
    if forced is not None:
        if forced not in (FMA, TILES):
            raise ValueError(f"{FAMILY_ENV}={forced!r}: expected {FMA!r} or {TILES!r}")
        if forced == TILES and not tiles_ready():
            raise ValueError(f"{FAMILY_ENV}=tiles, but this CPU or kernel gives no AMX tiles")
        return forced
    if not native.available() or not tiles_ready():
        return FMA
    chooser = kernel_choice.default()
    weights = [_sample_weight(*SAMPLE_SHAPE, seed) for seed in range(SAMPLE_WEIGHTS)]
    tiles = [pack_tiles(packed, scale_zero) for packed, scale_zero in weights]
    n = SAMPLE_SHAPE[0]
    times: dict[int, dict[str, float]] = {}
    for rows in SAMPLE_ROWS:
        x = torch.randn(rows, SAMPLE_SHAPE[1]).to(torch.bfloat16)
        candidates = {FMA: lambda x=x: [native_int4(x, p, sz) for p, sz in weights],
                      TILES: lambda x=x: [tiles_mm(x, t, n) for t in tiles]}
        name = f"int4 kernels {SAMPLE_WEIGHTS}x{SAMPLE_SHAPE[0]}x{SAMPLE_SHAPE[1]} rows{rows} " \
               f"{kernel_choice.threads_name(torch.get_num_threads())}"
        info = {"op": "family", "dtype": "int4", "shape": "x".join(map(str, SAMPLE_SHAPE)),
                "rows": str(rows), "threads": torch.get_num_threads()}
        chooser.choose(name, candidates, info)
        got = chooser.decision(name)
        times[rows] = got.times_ms if got is not None else {}
    return TILES if tiles_pay(times) else FMA


def tiles_pay(times: dict[int, dict[str, float]]) -> bool:
    """The rule on the measured times (ms per call, by rows then family): the tiles at most
    ONE_ROW_SLACK x the FMA kernel at one row, and faster at a verify's rows."""
    one, verify = (times.get(r, {}) for r in SAMPLE_ROWS)
    if not all(f in t for t in (one, verify) for f in (FMA, TILES)):
        return False
    return one[TILES] <= ONE_ROW_SLACK * one[FMA] and verify[TILES] < verify[FMA]


def _sample_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 4-bit weight in torch's layout (codes and bfloat16 scale and zero)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale_zero = (torch.rand(k // GROUP, n, 2, generator=g) * 0.01).to(torch.bfloat16)
    return packed, scale_zero
