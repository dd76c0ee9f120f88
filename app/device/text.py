"""The Device panel's numbers as text, from a DeviceFrame (pure, no Qt).

A value the engine could not measure (None) reads "—", never 0. GPU-only values are left out
(None) on a CPU device that has none of their fields."""
from __future__ import annotations

from kvscope.app.fmt import human_bytes

DASH = "—"
# key -> (label, tooltip)
LABELS = {
    "memory": ("memory", "the whole device (CPU: system RAM): used by every process, and free"),
    "process": ("kvscope", ("what the engine process holds (source: nvml as nvidia-smi shows "
                            "it, torch allocator reserve, or rss as ps shows it)")),
    "power": ("power", "board power draw / limit (NVML)"),
    "gpu": ("GPU", "share of time a kernel ran (NVML)"),
    "membw": ("mem bw", "share of time device memory was read or written (NVML)"),
    "clock": ("clock", "memory clock now / max (NVML)"),
    "temp": ("temp", "GPU temperature (NVML)"),
    "cpu": ("CPU", ("the engine process: 100 % = one core busy; in brackets its share "
                           "of all the machine's CPUs")),
    "system": ("system", "the whole machine's CPU use"),
}
GPU_FIELDS = {"gpu": ("gpu_utilization",), "membw": ("memory_utilization",),
              "clock": ("memory_clock_mhz", "memory_clock_max_mhz"), "temp": ("temperature_c",),
              "power": ("power_w", "power_limit_w")}


def title(f) -> str:
    return f"{f.device} · {f.name}" if f.name else f.device


def percent(x: float | None) -> str:
    return DASH if x is None else f"{x:.0f} %"


def _num(x: float | None, unit: str) -> str:
    return DASH if x is None else f"{x:.0f} {unit}"


def _pair(cur: float | None, top: float | None, unit: str) -> str:
    """'cur/max unit', or one of them, or a dash."""
    if top is None:
        return _num(cur, unit)
    return f"{DASH if cur is None else f'{cur:.0f}'}/{top:.0f} {unit}"


def used_of(used: int, total: int) -> str:
    """'110.0 / 140.0 GiB': the unit once when both share it."""
    a, b = human_bytes(used), human_bytes(total)
    unit = b.rpartition(" ")[2]
    if a.endswith(" " + unit):
        a = a[: -len(unit) - 1]
    return f"{a} / {b}"


def engine_cpu(f) -> str:
    if f.cpu_percent is None:
        return DASH
    share = f.cpu_percent / max(1, f.num_cpus)
    return f"{f.cpu_percent:.0f} % ({share:.1f} % of {f.num_cpus})"


def processes(f, most: int = 12) -> str:
    """The GPU's processes as nvidia-smi lists them, the engine marked; "" without NVML."""
    lines = []
    for p in f.processes[:most]:
        who = "kvscope (this engine)" if p.pid == f.pid else (p.name or "?")
        lines.append(f"pid {p.pid} {who}: {human_bytes(p.bytes) if p.bytes is not None else DASH}")
    if len(f.processes) > most:
        lines.append(f"… and {len(f.processes) - most} more")
    return "\n".join(lines)


def values(f) -> dict[str, str | None]:
    """Key -> text; None: leave the value (and its label) out."""
    out = {
        "memory": (f"{used_of(f.memory_used, f.memory_total)} used · "
                   f"{human_bytes(f.memory_free)} free"),
        "process": f"{human_bytes(f.process_bytes)} ({f.process_source})",
        "power": _pair(f.power_w, f.power_limit_w, "W"),
        "gpu": percent(f.gpu_utilization),
        "membw": percent(f.memory_utilization),
        "clock": _pair(f.memory_clock_mhz, f.memory_clock_max_mhz, "MHz"),
        "temp": _num(f.temperature_c, "°C"),
        "cpu": engine_cpu(f),
        "system": percent(f.system_cpu_percent),
    }
    if f.device.startswith("cpu"):
        for key, fields in GPU_FIELDS.items():
            if all(getattr(f, name) is None for name in fields):
                out[key] = None
    return out
