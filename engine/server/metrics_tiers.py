"""/metrics for the KV tiers beyond the pool (issue 56), under vLLM's names where it has them.

vLLM's CPU offloading counts the bytes it moves by direction (`kv_offload_total_bytes`
with a `transfer_type` such as "GPU_to_CPU"), and its prefix-cache hits by the tier that
supplied them (`prompt_tokens_cached_by_source` with a `source`); the tiers' sizes are gauges
by `medium` (vLLM's KV-event media: "CPU" the host tier, "STORAGE" the disk tier). The pool's
own medium is "GPU" on CUDA and "CPU" on a CPU-only engine, as the KV events say.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvscope.ipc import messages as m

HOST, DISK = "CPU", "STORAGE"


def tier_families(prefix: str, stats: m.EngineStats, labels: dict[str, str]
                  ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    if not (stats.kv_host_capacity_bytes or stats.kv_disk_capacity_bytes):
        return
    names, values = list(labels), list(labels.values())
    pool = "GPU" if stats.device.startswith("cuda") else "CPU"
    moved = CounterMetricFamily(prefix + "kv_offload_total_bytes",
                                "KV bytes moved between the pool and its tiers.",
                                labels=[*names, "transfer_type"])
    moved.add_metric([*values, f"{pool}_to_{HOST}"], stats.kv_offloaded_bytes)
    moved.add_metric([*values, f"{HOST}_to_{pool}"],
                     stats.kv_onboarded_host_blocks * _block_bytes(stats))
    moved.add_metric([*values, f"{DISK}_to_{pool}"],
                     stats.kv_onboarded_disk_blocks * _block_bytes(stats))
    yield moved
    blocks = CounterMetricFamily(prefix + "kv_offload_blocks",
                                 "KV blocks moved between the pool and its tiers.",
                                 labels=[*names, "transfer_type"])
    blocks.add_metric([*values, f"{pool}_to_{HOST}"], stats.kv_offloaded_blocks)
    blocks.add_metric([*values, f"{pool}_to_{DISK}"], stats.kv_disk_written_blocks)
    blocks.add_metric([*values, f"{HOST}_to_{pool}"], stats.kv_onboarded_host_blocks)
    blocks.add_metric([*values, f"{DISK}_to_{pool}"], stats.kv_onboarded_disk_blocks)
    yield blocks
    hits = CounterMetricFamily(prefix + "prompt_tokens_cached_by_source",
                               "Cached prompt tokens, by the tier that supplied them.",
                               labels=[*names, "source"])
    tiered = stats.prefix_cache_hits_host + stats.prefix_cache_hits_disk
    hits.add_metric([*values, "device"], max(0, stats.prefix_cache_hits - tiered))
    hits.add_metric([*values, "host"], stats.prefix_cache_hits_host)
    hits.add_metric([*values, "disk"], stats.prefix_cache_hits_disk)
    yield hits
    refused = CounterMetricFamily(prefix + "kv_offload_refused_blocks",
                                  "Disk-tier blocks refused (bad key, checksum or size) and "
                                  "deleted, never loaded.", labels=names)
    refused.add_metric(values, stats.kv_disk_refused_blocks)
    yield refused
    for key, doc, host, disk in (
            ("kv_offload_used_blocks", "KV blocks held in each tier.",
             stats.kv_host_blocks, stats.kv_disk_blocks),
            ("kv_offload_used_bytes", "Bytes held in each tier.",
             stats.kv_host_bytes, stats.kv_disk_bytes),
            ("kv_offload_capacity_bytes", "Each tier's byte budget.",
             stats.kv_host_capacity_bytes, stats.kv_disk_capacity_bytes)):
        gauge = GaugeMetricFamily(prefix + key, doc, labels=[*names, "medium"])
        gauge.add_metric([*values, HOST], host)
        gauge.add_metric([*values, DISK], disk)
        yield gauge


def _block_bytes(stats: m.EngineStats) -> int:
    return stats.kv_bytes_per_token * stats.block_size
