"""Check the device monitor against the tools people trust: nvidia-smi on CUDA, ps on CPU.

    python -m benchmarks.device.device_check [--device cuda] [--tolerance 0.05]

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
                      "power.draw,utilization.memory,clocks.mem,clocks.max.mem,power.limit")
    card = next((g for g in gpus if g[0] == frame.name), gpus[0])
    apps = {int(p): float(mib) for p, mib in nvidia_smi("pid,used_memory", "compute-apps")
            if p.isdigit() and _number(mib)}
    return [("memory total (MiB)", frame.memory_total / MiB, float(card[1])),
            ("memory used (MiB)", frame.memory_used / MiB, float(card[2])),
            ("engine process (MiB)", frame.process_bytes / MiB, apps.get(os.getpid())),
            ("utilization (%)", frame.gpu_utilization, _float(card[3])),
            ("memory utilization (%)", frame.memory_utilization, _float(card[6])),
            ("memory clock (MHz)", frame.memory_clock_mhz, _float(card[7])),
            ("memory clock max (MHz)", frame.memory_clock_max_mhz, _float(card[8])),
            ("temperature (C)", frame.temperature_c, _float(card[4])),
            ("power (W)", frame.power_w, _float(card[5])),
            ("power limit (W)", frame.power_limit_w, _float(card[9]))]


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

    engine = LLMEngine(EngineConfig(device=args.device))
    for _ in range(4):
        engine.add_request(list(range(100, 400)), SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        engine.step()
    report = compare_with_tools(engine, args.tolerance)
    print(report["summary"])
    print(f"{'':<24} {'kvscope':>10} {'reference':>10} {'diff':>7}")
    for r in report["rows"]:
        if r["diff"] is None:
            print(f"{r['name']:<24} {_show(r['kvscope']):>10} {_show(r['reference']):>10}")
            continue
        print(f"{r['name']:<24} {r['kvscope']:10.1f} {r['reference']:10.1f} "
              f"{r['diff'] * 100:6.1f}%{'  FAIL' if not r['ok'] else ''}")
    return 0 if report["ok"] else 1


def compare_with_tools(engine, tolerance: float) -> dict:
    """One device sample of a running engine beside nvidia-smi's (CUDA) or ps's (CPU) numbers.
    Memory rows must agree within `tolerance`; utilization, clocks, temperature and power
    move between the two reads, so they are reported only."""
    from kvscope.engine.server.device_monitor import DeviceMonitor

    frame = DeviceMonitor(engine).sample()
    rows = cuda_rows(frame) if frame.device.startswith("cuda") else cpu_rows(frame)
    out = []
    for name, ours, ref in rows:
        diff = None if ours is None or ref is None else abs(ours - ref) / max(abs(ref), 1e-9)
        checked = "(MiB)" in name and diff is not None
        out.append({"name": name, "kvscope": ours, "reference": ref, "diff": diff,
                    "checked": checked, "ok": not checked or diff <= tolerance})
    summary = (f"{frame.device} · {frame.name}: weights {frame.weights_bytes / MiB:.0f} MiB, "
               f"KV pool {frame.kv_pool_bytes / MiB:.0f} MiB, activations "
               f"{(frame.activations_bytes or 0) / MiB:.0f} MiB, allocator free "
               f"{(frame.allocator_free_bytes or 0) / MiB:.0f} MiB, other "
               f"{frame.other_bytes / MiB:.0f} MiB ({frame.process_source})")
    return {"summary": summary, "rows": out, "ok": all(r["ok"] for r in out)}


def _show(x) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
