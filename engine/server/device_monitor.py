"""What the engine's device holds and how busy it is: the `device` topic and the memory gauges
of /metrics. Sampled on the engine thread about once a second, so the KV numbers and the
memory numbers describe the same moment.

CUDA: the card's memory from the driver (what nvidia-smi shows), the torch allocator's view of
our own part, and NVML (nvidia-ml-py, optional) for utilization, clocks, temperature, power and
this process's memory. CPU: system RAM and this process's resident set (what ps shows).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import torch

from kvscope.engine.server.nvml import NvmlDevice, open_nvml_device
from kvscope.ipc import messages as m


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (tied or aliased ones counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_tensors(model) -> list[torch.Tensor]:
    """Every tensor the model keeps: weights in their stored form (int4/int8 codes and scales
    when quantized, so the figure is the real bytes), norms and the rope tables."""
    return model.tensors()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


class DeviceMonitor:
    def __init__(self, engine, nvml: NvmlDevice | None = None) -> None:
        self.engine = engine
        self.is_cuda = str(engine.device).startswith("cuda")
        self.index = (torch.device(engine.device).index or 0) if self.is_cuda else None
        self.process = psutil.Process(os.getpid())
        self.process.cpu_percent(None)  # the first call only starts the interval
        psutil.cpu_percent(None)
        self.weights_bytes = unique_bytes(model_tensors(engine.model))
        self.nvml = nvml if nvml is not None or not self.is_cuda else open_nvml_device(self.index)
        self.name = self._device_name()

    def _device_name(self) -> str:
        if not self.is_cuda:
            return cpu_name()
        nvml_name = self.nvml.name() if self.nvml else None
        return nvml_name or torch.cuda.get_device_name(self.index)

    def kv_parts(self) -> dict[str, int]:
        pool, bm = self.engine.pool, self.engine.block_manager
        per_block = pool.nbytes // max(1, pool.num_blocks)
        return {"kv_pool_bytes": pool.nbytes,
                "kv_used_bytes": bm.num_used_blocks * per_block,
                "kv_cached_bytes": bm.num_cached_free_blocks * per_block}

    def sample(self, seq: int = 0) -> m.DeviceFrame:
        on_card = self.nvml.processes() if self.nvml else {}
        memory = (self._cuda_memory(on_card.get(os.getpid())) if self.is_cuda
                  else self._cpu_memory())
        return m.DeviceFrame(
            seq=seq, time=time.time(), pid=os.getpid(), device=str(self.engine.device),
            name=self.name, weights_bytes=self.weights_bytes, **self.kv_parts(), **memory,
            **(self.nvml.busy() if self.nvml else {}),
            cpu_percent=self.process.cpu_percent(None), num_cpus=psutil.cpu_count() or 1,
            system_cpu_percent=psutil.cpu_percent(None), processes=gpu_processes(on_card))

    def _cpu_memory(self) -> dict:
        vm = psutil.virtual_memory()
        rss = self.process.memory_info().rss
        kv = self.engine.pool.nbytes
        return {"memory_total": vm.total, "memory_used": vm.total - vm.available,
                "memory_free": vm.available, "process_bytes": rss, "process_source": "rss",
                "other_bytes": max(0, rss - self.weights_bytes - kv)}

    def _cuda_memory(self, nvml_process: int | None) -> dict:
        free, total = torch.cuda.mem_get_info(self.index)
        allocated = torch.cuda.memory_allocated(self.index)
        reserved = torch.cuda.memory_reserved(self.index)
        return cuda_breakdown(free, total, allocated, reserved, self.weights_bytes,
                              self.engine.pool.nbytes, nvml_process)


MAX_PROCESSES = 32


def gpu_processes(used: dict[int, int | None]) -> list[m.DeviceProcess]:
    """The card's processes, biggest first, named as ps would name them."""
    out = [m.DeviceProcess(pid, process_name(pid), nbytes) for pid, nbytes in used.items()]
    out.sort(key=lambda p: -(p.bytes or 0))
    return out[:MAX_PROCESSES]


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return ""  # gone, or outside this container's pid namespace


def cuda_breakdown(free: int, total: int, allocated: int, reserved: int, weights: int,
                   kv_pool: int, nvml_process: int | None) -> dict:
    """Our part of the card from the allocator's counters. Without NVML's per-process figure
    the reserve is the best lower bound (it misses the CUDA context, ~0.3-0.5 GiB)."""
    process = nvml_process if nvml_process is not None else reserved
    return {"memory_total": total, "memory_used": total - free, "memory_free": free,
            "process_bytes": process,
            "process_source": "nvml" if nvml_process is not None else "torch",
            "activations_bytes": max(0, allocated - weights - kv_pool),
            "allocator_free_bytes": max(0, reserved - allocated),
            "other_bytes": max(0, process - reserved)}
