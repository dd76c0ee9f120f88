"""The native kernels built for every instruction set this machine has, for the kernel tests.

`library()` is built with -march=native (AVX-512 and AMX where the CPU has them); a user's CPU
may have only AVX2, or neither, and the kernels take other paths there (8-wide tiles, the
portable vector code). Each path is tested here on the builds the machine can run: native,
x86-64-v3 (AVX2 + FMA) and x86-64-v2 (SSE4.2: the compiler's portable vectors), as far as the
CPU has them."""
from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from kvscope.kernels import native

# -march level -> the CPU flags it needs
LEVELS = {"x86-64-v3": ("avx2", "fma", "bmi2", "f16c"), "x86-64-v2": ("sse4_2", "popcnt")}


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def levels() -> list[str]:
    """"native" and every lower x86-64 level this CPU runs."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    have = _flags()
    return ["native", *(m for m, need in LEVELS.items() if all(f in have for f in need))]


def build(level: str) -> ctypes.CDLL:
    """The kernels for `level`; skips the test where that build fails."""
    lib = native.library() if level == "native" else native.variant(level)
    if lib is None:
        pytest.skip(f"the kernels did not build for {level}")
    return lib
