"""What a kernel choice depends on besides the call's shape: the CPU (model name and
instruction flags), the kernel sources and the torch build. The choice cache
(kernels.kernel_cache) is valid only for the key it was measured under, as Triton's autotune
cache is keyed by its kernel and device.

Why each part: the same "AMD EPYC" model name covers parts with and without AVX-512 BF16
(the flags tell them apart, and decide whether torch's bfloat16 matmul uses bf16 dot
products), a changed kernel source or torch version changes the timings being compared.
"""
from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import torch

HERE = Path(__file__).parent
# Python sources whose code is one of the measured candidates or decides among them; the C
# sources come from kernels.native (whatever the build list holds at the time).
PY_SOURCES = (HERE / "cpu_linear.py", HERE / "cpu_int4.py", HERE / "cpu_int8.py",
              HERE / "kernel_choice.py")
# Flags shown in the table (the key hashes all of them): the ones that decide matmul speed.
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                 "amx_tile", "asimd", "sve", "bf16")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def _field(text: str, names: tuple[str, ...]) -> str:
    """The first `name : value` line's value for any of names ('' if none)."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in names:
            return value.strip()
    return ""


@functools.cache
def cpu_model() -> str:
    return (_field(_cpuinfo(), ("model name", "cpu model", "hardware"))
            or platform.processor() or platform.machine() or "unknown")


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's instruction flags, sorted (x86 'flags', arm 'Features'); () if unknown."""
    return tuple(sorted(set(_field(_cpuinfo(), ("flags", "features")).split())))


def sources_hash(paths: tuple[Path, ...] | None = None) -> str:
    """sha256 (16 hex digits) of the kernel sources: the native build list and headers, and
    the Python candidates. A missing file counts as empty (its absence changes the hash)."""
    if paths is None:
        from kvscope.kernels import native
        paths = (*native.SOURCES, *native.HEADERS, *PY_SOURCES)
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()[:16]


def machine_key(model: str | None = None, flags: tuple[str, ...] | None = None,
                sources: str | None = None, torch_version: str | None = None
                ) -> dict[str, str]:
    """The key a cache of choices is valid for (each part defaults to this machine's)."""
    flags = cpu_flags() if flags is None else tuple(sorted(set(flags)))
    return {
        "cpu_model": cpu_model() if model is None else model,
        "cpu_flags_sha256": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
        "cpu_notable_flags": " ".join(f for f in NOTABLE_FLAGS if f in flags),
        "kernel_sources_sha256": sources_hash() if sources is None else sources,
        "torch": torch.__version__ if torch_version is None else torch_version,
    }
