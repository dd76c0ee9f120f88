"""The native CPU kernels (kernels/cpu_*.c): built on first use with the system C compiler
into one shared library, loaded with ctypes.

Plain C, no torch headers, so the build takes a second or two (`cc -O3 -march=native
-fopenmp`; without OpenMP the kernels run on one thread), into
a cache folder keyed by the sources, the compiler and the flags (parallel processes build
beside the target and rename, so none loads half a file). Where no compiler works,
`library()` is None and the engine keeps the torch reference kernels; `KVSCOPE_CPU_KERNELS=off`
forces that. ctypes releases the GIL for the length of a call.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_decode_attention.c", HERE / "cpu_decode_glue.c",
           HERE / "cpu_small_gemm.c", HERE / "cpu_int4_gemm.c", HERE / "cpu_kv_write.c",
           HERE / "cpu_decode_step.c", HERE / "cpu_amx_gemm.c",
           HERE / "cpu_dpbf16_gemm.c", HERE / "cpu_int4_tiles.c",
           HERE / "cpu_int8_gemm.c")
# not compiled on their own, but part of the cache key
HEADERS = (HERE / "cpu_vec.h", HERE / "cpu_team.h", HERE / "cpu_glue.h")
ENV = "KVSCOPE_CPU_KERNELS"
# A hung compiler must not hang the engine, but a loaded machine compiles slowly: 120 s
# timed out on a 2-core machine running several test processes at once.
BUILD_TIMEOUT_S = 600
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native", "-fopenmp-simd"],
             ["-O3", "-fopenmp-simd"], ["-O2"])

P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    # ..., anchor_len, window, softcap, parallel
    "kvscope_paged_decode": [P, P, P, P, I64, P, I64, I64, P, P, P, P, I64, I64, I64, I64, INT,
                             F32, INT, P, P, P, I64, I64, F32, INT],
    "kvscope_add_rms_norm": [P, P, P, F32, P, I64, I64, INT],
    "kvscope_add": [P, P, I64, INT],
    "kvscope_silu_mul": [P, P, I64, I64, INT],
    "kvscope_rope_write": [P, I64, P, P, P, P, P, P, P, I64, I64, I64, INT, INT],
    "kvscope_norm_rope_write": [P, I64, P, P, P, I64, P, P, F32, P, P, P, P, I64, I64, I64, INT,
                                INT],
    "kvscope_gelu_tanh_mul": [P, P, I64, I64, INT],
    "kvscope_add_normed_rms_norm": [P, P, P, P, F32, P, I64, I64, INT],
    "kvscope_gemm": [P, INT, P, INT, P, INT, P, I64, I64, I64, INT, INT],  # ..., parallel, paths
    "kvscope_int4_gemm": [P, INT, P, INT, P, P, I64, I64, I64, INT, I64],
    "kvscope_int4_tiles_gemm": [P, INT, P, INT, P, I64, I64, I64, INT],
    "kvscope_int8_gemm": [P, INT, P, INT, P, P, I64, I64, I64, INT],  # ..., parallel
    "kvscope_int8_dequant_bf16": [P, P, P, I64, I64],
    "kvscope_int4_tiles_pack": [P, P, P, I64, I64],
    "kvscope_int4_tiles_ready": [],
    "kvscope_kv_write": [P, I64, I64, I64, P, P, P, P, P, P, INT],
    # ..., kind, io, R, shift, gain, q_gain (the KV pool's kind and transforms)
    "kvscope_rope_write_kv": [P, I64, P, P, P, I64, P, P, F32, P, P, P, P, P, P, I64, I64, I64,
                              INT, INT, P, P, P, P],
    "kvscope_rotate_rows": [P, I64, I64, P, P, INT],
    "kvscope_decode_step": [P, P],  # (step_plan, step_layer[]): engine/model/fused/one_region.py
    "kvscope_amx_ready": [],
    "kvscope_amx_fits": [I64, I64],  # (N, K): the bfloat16 tiles apply
    "kvscope_dpbf16_fits": [I64],  # (K): the AVX-512 BF16 dot products apply
}


RETURNS_STATUS = ("kvscope_paged_decode", "kvscope_gemm", "kvscope_int4_gemm",
                  "kvscope_int8_gemm", "kvscope_int4_tiles_gemm", "kvscope_int4_tiles_ready",
                  "kvscope_decode_step", "kvscope_amx_ready",
                  "kvscope_amx_fits", "kvscope_dpbf16_fits")


def cache_dirs() -> list[Path]:
    """Where a built library may live: the user's cache, else a folder in the temp dir."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "kvscope" / "kernels",
            Path(tempfile.gettempdir()) / f"kvscope-kernels-{os.getuid()}"]


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


def available() -> bool:
    return enabled() and library() is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    """Build (once per sources/compiler/flags) and load the kernels; None if that fails."""
    import torch  # noqa: F401 - first, so the library binds to torch's OpenMP runtime
    compiler = os.environ.get("CC", "cc")
    source = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    for flags in FLAG_SETS:
        key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        lib = _load(compiler, flags, f"kvscope-cpu-{key}.so")
        if lib is not None:
            return _configured(lib)
    return None


@functools.cache
def variant(march: str) -> ctypes.CDLL | None:
    """The kernels built for the instruction set `march` (a -march value such as
    "x86-64-v3": AVX2 and FMA) rather than this CPU's best, loaded beside `library()`; None
    if that build fails. For the tests, which run each kernel on every instruction set the
    machine has: the engine always runs `library()`."""
    import torch  # noqa: F401 - first, as in library()
    compiler = os.environ.get("CC", "cc")
    flags = ["-O3", f"-march={march}", "-fopenmp"]
    source = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    lib = _load(compiler, flags, f"kvscope-cpu-{key}.so")
    return None if lib is None else _configured(lib)


def _configured(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kvscope_init_tables()
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int if name in RETURNS_STATUS else None
    return lib


def require_library() -> ctypes.CDLL:
    """The loaded kernels, for a caller that found them `available()`; raises if they are not
    (a caller that skipped the check would otherwise fail on None's missing attribute)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are not available (disabled by {ENV}, or "
                           "no C compiler could build them)")
    return lib


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer as a kernel argument; None (a NULL pointer) for no tensor."""
    return None if t is None else t.data_ptr()


def _load(compiler: str, flags: list[str], name: str) -> ctypes.CDLL | None:
    for folder in cache_dirs():
        target = folder / name
        if target.exists() or _build_once(compiler, flags, target):
            try:
                return ctypes.CDLL(str(target))
            except OSError:
                continue
    return None


def _build_once(compiler: str, flags: list[str], target: Path) -> bool:
    """Build under a lock file beside the target: processes starting together (a test run,
    a server and a benchmark) wait for one compile instead of each running its own, which
    on a busy 2-core machine made every one of them slow enough to hit the timeout."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_suffix(".lock"), "w")  # noqa: SIM115 - held across the build
    except OSError:
        return _build(compiler, flags, target)
    with lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock here: build without it, as before
            pass
        return target.exists() or _build(compiler, flags, target)


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError:  # an unwritable cache: the caller tries the next folder
        return False
    os.close(fd)
    cmd = [compiler, *flags, "-shared", "-fPIC", *map(str, SOURCES), "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"kvscope: building the CPU kernels failed ({e})", file=sys.stderr)
        os.unlink(tmp)
        return False
    if done.returncode != 0:
        print(f"kvscope: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        os.unlink(tmp)
        return False
    os.replace(tmp, target)
    return True
