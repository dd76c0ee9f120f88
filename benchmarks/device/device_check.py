"""Check the device monitor against the tools people trust: nvidia-smi on CUDA, ps on CPU.

    python -m kvscope.benchmarks.device.device_check [--device cuda] [--tolerance 0.05]

Loads the engine, runs a few requests (so activations and the allocator's cache exist), takes
one device sample and the same numbers from nvidia-smi / ps a moment later, and prints them
side by side. Exits 1 when a number differs by more than the tolerance.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

MiB = 2**20


def nvidia_smi(query: str, what: str = "gpu") -> list[list[str]]:
    cmd = ["nvidia-smi", f"--query-{what}={query}", "--format=csv,noheader,nounits"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


def cuda_rows(frame) -> list[tuple[str, float, float | None]]:
    """(name, ours, nvidia-smi) in MiB or plain units; the card is found by its name."""
    gpus = nvidia_smi("name,memory.total,memory.used,utilization.gpu,temperature.gpu,"
                      "power.draw")
    card = next((g for g in gpus if g[0] == frame.name), gpus[0])
    apps = {int(p): float(mib) for p, mib in nvidia_smi("pid,used_memory", "compute-apps")
            if p.isdigit() and _number(mib)}
    return [("memory total (MiB)", frame.memory_total / MiB, float(card[1])),
            ("memory used (MiB)", frame.memory_used / MiB, float(card[2])),
            ("engine process (MiB)", frame.process_bytes / MiB, apps.get(os.getpid())),
            ("utilization (%)", frame.gpu_utilization, _float(card[3])),
            ("temperature (C)", frame.temperature_c, _float(card[4])),
            ("power (W)", frame.power_w, _float(card[5]))]


def cpu_rows(frame) -> list[tuple[str, float, float | None]]:
    ps = subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True,
                        text=True, check=True).stdout
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return [("engine RSS (MiB)", frame.process_bytes / MiB, int(ps) / 1024),
            ("memory total (MiB)", frame.memory_total / MiB, total / 1024)]


def _number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _float(s: str) -> float | None:
    return float(s) if _number(s) else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="device_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--tolerance", type=float, default=0.05)
    args = p.parse_args(argv)
    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.server.device_monitor import DeviceMonitor

    engine = LLMEngine(EngineConfig(device=args.device))
    for _ in range(4):
        engine.add_request(list(range(100, 400)), SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        engine.step()
    monitor = DeviceMonitor(engine)
    frame = monitor.sample()
    rows = cuda_rows(frame) if frame.device.startswith("cuda") else cpu_rows(frame)
    print(f"{frame.device} · {frame.name}: weights {frame.weights_bytes / MiB:.0f} MiB, KV pool "
          f"{frame.kv_pool_bytes / MiB:.0f} MiB, activations "
          f"{(frame.activations_bytes or 0) / MiB:.0f} MiB, allocator free "
          f"{(frame.allocator_free_bytes or 0) / MiB:.0f} MiB, other "
          f"{frame.other_bytes / MiB:.0f} MiB ({frame.process_source})")
    bad = 0
    print(f"{'':<22} {'kvscope':>10} {'reference':>10} {'diff':>7}")
    for name, ours, ref in rows:
        if ours is None or ref is None:
            print(f"{name:<22} {ours if ours is not None else '-':>10} "
                  f"{ref if ref is not None else '-':>10}")
            continue
        diff = abs(ours - ref) / max(abs(ref), 1e-9)
        # Utilization, temperature and power move between the two reads: report only.
        checked = "(MiB)" in name
        bad += checked and diff > args.tolerance
        print(f"{name:<22} {ours:10.1f} {ref:10.1f} {diff * 100:6.1f}%"
              f"{'  FAIL' if checked and diff > args.tolerance else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
