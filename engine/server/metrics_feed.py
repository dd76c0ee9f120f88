"""What the engine thread hands its watchers between steps: the device sample that the
`device` topic and /metrics share, and /metrics' state, refreshed when the engine changed."""
from __future__ import annotations

import time

from kvscope.engine.server import snapshots
from kvscope.engine.server.device_monitor import DeviceMonitor
from kvscope.engine.server.metrics import EngineMetrics, EngineState
from kvscope.engine.server.metrics_moe import expert_load
from kvscope.engine.server.metrics_priority import scheduler_counts
from kvscope.ipc import messages as m

DEVICE_INTERVAL = 1.0  # what nvidia-smi and nvitop sample at; NVML itself averages over ~1 s
METRICS_INTERVAL = 0.05  # /metrics counters refresh at most this often while busy


class MetricsFeed:
    def __init__(self, engine, metrics: EngineMetrics | None) -> None:
        self.engine, self.metrics = engine, metrics
        self.monitor = DeviceMonitor(engine)
        self.sample: m.DeviceFrame | None = None
        self.kv_totals: dict | None = None
        self.sampled_at = self.totals_at = self.published_at = float("-inf")
        self.published_version = 0

    def device(self) -> m.DeviceFrame:
        """A device sample at most half a second old."""
        now = time.monotonic()
        if now - self.sampled_at >= DEVICE_INTERVAL / 2:
            self.sample, self.sampled_at = self.monitor.sample(), now
        return self.sample

    def refresh(self, version: int) -> None:
        """Hand /metrics a fresh state when the engine's state `version` moved: at most every
        METRICS_INTERVAL while busy, at once when it goes idle, so totals read at rest are
        exactly the stream's. The device and the KV waste (a pass over the pool) refresh at
        DEVICE_INTERVAL."""
        if self.metrics is None:
            return
        now = time.monotonic()
        busy = self.engine.has_unfinished()
        slow_due = now - self.totals_at >= DEVICE_INTERVAL
        throttled = busy and now - self.published_at < METRICS_INTERVAL
        if not slow_due and (version == self.published_version or throttled):
            return
        if slow_due or not busy:
            self.kv_totals, self.totals_at = snapshots.block_totals(self.engine), now
        self.metrics.publish(EngineState(self.engine.stats(), self.kv_totals, self.device(),
                                         scheduler_counts(self.engine.scheduler,
                                                          self.engine.interrupt.num_interrupted),
                                         experts=expert_load(self.engine)))
        self.published_at, self.published_version = now, version
