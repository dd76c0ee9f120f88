"""NVML (nvidia-ml-py, optional) for one CUDA device: utilization, clocks, temperature, power
and per-process memory. Absent or failing NVML gives None for those fields, never an error:
a laptop without the library, a container without the driver's NVML, or a card that does not
report power must still serve."""
from __future__ import annotations

import os
from typing import Any


def _call(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - pynvml.NVMLError and friends: the field is unknown
        return default


class NvmlDevice:
    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    def name(self) -> str | None:
        name = _call(self.nvml.nvmlDeviceGetName, self.handle)
        return name.decode() if isinstance(name, bytes) else name

    def busy(self) -> dict[str, float | None]:
        n, h = self.nvml, self.handle
        rates = _call(n.nvmlDeviceGetUtilizationRates, h)
        power = _call(n.nvmlDeviceGetPowerUsage, h)  # milliwatts
        limit = _call(n.nvmlDeviceGetEnforcedPowerLimit, h)
        return {
            "gpu_utilization": None if rates is None else float(rates.gpu),
            "memory_utilization": None if rates is None else float(rates.memory),
            "memory_clock_mhz": _float(_call(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM)),
            "memory_clock_max_mhz": _float(_call(n.nvmlDeviceGetMaxClockInfo, h,
                                                 n.NVML_CLOCK_MEM)),
            "temperature_c": _float(_call(n.nvmlDeviceGetTemperature, h,
                                          n.NVML_TEMPERATURE_GPU)),
            "power_w": None if power is None else power / 1000.0,
            "power_limit_w": None if limit is None else limit / 1000.0,
        }

    def processes(self) -> dict[int, int | None]:
        """pid -> device memory of every compute and graphics process on the card (None
        where the driver does not report it)."""
        found: dict[int, int | None] = {}
        for query in ("nvmlDeviceGetComputeRunningProcesses",
                      "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(self.nvml, query, None)
            for p in (_call(fn, self.handle, default=[]) if fn else []):
                used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else None
                found[p.pid] = used if found.get(p.pid) is None else found[p.pid]
        return found

    def process_bytes(self, pid: int) -> int | None:
        """This process's memory on the card as nvidia-smi lists it; None when NVML cannot
        see it (e.g. a container's pid namespace hides the host pid)."""
        return self.processes().get(pid)


def _float(x) -> float | None:
    return None if x is None else float(x)


def open_nvml_device(index: int) -> NvmlDevice | None:
    """The NVML handle of torch's cuda:index, or None without NVML. CUDA_VISIBLE_DEVICES
    renumbers devices for torch but not for NVML, so the handle is found by UUID or PCI bus."""
    try:
        import pynvml
    except ImportError:
        return None
    if _call(pynvml.nvmlInit, default=False) is False:
        return None
    handle = _find_handle(pynvml, index)
    return None if handle is None else NvmlDevice(pynvml, handle)


def _find_handle(nvml, index: int):
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        handle = _call(nvml.nvmlDeviceGetHandleByUUID, f"GPU-{uuid}")
        if handle is not None:
            return handle
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = (f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:"
               f"{getattr(props, 'pci_device_id', 0):02X}.0")
        handle = _call(nvml.nvmlDeviceGetHandleByPciBusId, pci)
        if handle is not None:
            return handle
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None  # the index would name another card
    return _call(nvml.nvmlDeviceGetHandleByIndex, index)
