"""Where a KV pool's memory comes from, and how a rebuilt pool gives the old one back.

On the host a pool is tens to hundreds of MiB in per-layer tensors of a few MiB each. Taken
from malloc, glibc raises its mmap threshold to the size of the first big block freed, so
after one reconfigure the next pool lands in the heap of the engine thread's arena, and what
such a heap held is kept, not returned: a few reconfigures left a process two pools larger.
So host pools map their own anonymous memory (returned to the OS when the tensor dies,
whatever malloc does), and a rebuild trims malloc's arenas too. On CUDA the caching
allocator keeps freed segments: a rebuild empties its cache, so the next pool (and anyone
else on the device) gets the room back.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import math
import mmap
from collections.abc import Callable
from functools import cache
from typing import Any, cast

import torch

# Smaller tensors (scales of tiny pools) come from torch's allocator: a mapping per tensor
# rounds each up to a page, and malloc keeps small blocks nowhere that matters.
MIN_MAPPED_BYTES = 1 << 20
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def zeros(size: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed pool tensor. On the host, at least MIN_MAPPED_BYTES: its own private mapping,
    unmapped when the last view of it is freed (the tensor holds the mmap object)."""
    nbytes = math.prod(size) * torch.empty(0, dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_MAPPED_BYTES or not _MAP_FLAGS:
        return torch.zeros(size, dtype=dtype, device=device)
    # Mapped one huge page longer than asked, to start the tensor at a huge page's edge, and
    # asked for huge pages: a decode step reads the pool's blocks in table order, anywhere in
    # it, and with 4 KiB pages every block is a TLB miss (float32 attention at 6000 tokens of
    # context, 30 layers from memory: 16.1 -> 15.1-15.6 ms). The spare head is never touched,
    # so it costs address space, not memory.
    spare = HUGE_PAGE if nbytes >= HUGE_PAGE else 0
    buf = mmap.mmap(-1, nbytes + spare, flags=_MAP_FLAGS)  # anonymous pages read as zeros
    offset = -_address(buf) % HUGE_PAGE if spare else 0
    if spare and hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    tensor = torch.frombuffer(buf, dtype=dtype, count=math.prod(size),
                              offset=offset).view(size)
    # Touch every page now, as torch.zeros would: a pool that does not fit fails here, at
    # the reconfigure, not later at a page fault mid-step, and the resident set is the pool.
    tensor.zero_()
    return tensor


def _address(buf: mmap.mmap) -> int:
    """Where a mapping starts."""
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # an export left alive would keep the mapping from closing


def release_freed(device: str) -> None:
    """Hand memory freed with the old pool back: CUDA's cached segments, malloc's free pages."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (musl, macOS, Windows: nothing to call)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return cast("Callable[[int], int]", trim)


def available_bytes(device: str) -> int:
    """Memory a new pool can take now: the host's available memory, or on CUDA the device's
    free memory plus what the caching allocator holds unused (empty_cache returns it)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(free + cached)
    return _host_available()


def _host_available() -> int:
    """The kernel's MemAvailable (free plus what it can reclaim), else psutil's figure."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    psutil: Any = importlib.import_module("psutil")  # no type stubs in the environment
    return int(psutil.virtual_memory().available)
