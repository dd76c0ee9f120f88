"""What the window plots of a vLLM server, derived from two /metrics scrapes.

Gauges are read as they are; rates, latency percentiles and the prefix-cache hit rate come
from what the counters and histograms gained between the two scrapes. Names are vLLM's, with
its older spellings as fallbacks (gpu_cache_usage_perc, gpu_prefix_cache_*,
time_per_output_token_seconds), so several vLLM versions and `kvscope serve --metrics-prefix
vllm` all read the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvscope.app.vllm.prometheus_text import Samples, buckets, label, labels_of, total


@dataclass(frozen=True)
class ServerSample:
    time: float  # wall clock of the newer scrape
    interval_s: float  # since the older one
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1
    preemptions: float | None  # in the interval
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    steps: float | None  # engine steps in the interval (iteration_tokens_total count)
    ttft_p50_s: float | None  # of the requests whose first token came in the interval
    ttft_p90_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    prefix_hit_rate: float | None  # cached tokens / queried tokens, in the interval
    block_size: int | None
    num_blocks: int | None
    model: str | None
    cache_config: dict[str, str]  # vllm:cache_config_info's labels (block_size, cache_dtype, ...)


def sample(old: Samples, new: Samples, old_t: float, new_t: float) -> ServerSample:
    dt = max(1e-9, new_t - old_t)

    def gain(*names: str) -> float | None:
        a, b = total(old, *names), total(new, *names)
        return None if a is None or b is None else max(0.0, b - a)

    def per_s(*names: str) -> float | None:
        g = gain(*names)
        return None if g is None else g / dt

    hits = gain("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
    queries = gain("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
    ttft = _histogram_gain(old, new, "vllm:time_to_first_token_seconds")
    itl = _histogram_gain(old, new, "vllm:inter_token_latency_seconds") or \
        _histogram_gain(old, new, "vllm:time_per_output_token_seconds")
    block_size = label(new, "vllm:cache_config_info", "block_size")
    num_blocks = label(new, "vllm:cache_config_info", "num_gpu_blocks")
    return ServerSample(
        time=new_t, interval_s=dt,
        running=total(new, "vllm:num_requests_running"),
        waiting=total(new, "vllm:num_requests_waiting"),
        kv_usage=_mean(new, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        preemptions=gain("vllm:num_preemptions_total"),
        prompt_tokens_per_s=per_s("vllm:prompt_tokens_total"),
        generation_tokens_per_s=per_s("vllm:generation_tokens_total"),
        steps=gain("vllm:iteration_tokens_total_count"),
        ttft_p50_s=quantile(ttft, 0.5), ttft_p90_s=quantile(ttft, 0.9),
        itl_p50_s=quantile(itl, 0.5), itl_p90_s=quantile(itl, 0.9),
        prefix_hit_rate=None if not queries else hits / queries if hits is not None else None,
        block_size=_int(block_size), num_blocks=_int(num_blocks),
        model=label(new, "vllm:num_requests_running", "model_name"),
        cache_config=labels_of(new, "vllm:cache_config_info"))


def _mean(samples: Samples, *names: str) -> float | None:
    """A usage ratio averaged over engines (summing ratios would exceed 1)."""
    for name in names:
        values = [v for _, v in samples.get(name, [])]
        if values:
            return sum(values) / len(values)
    return None


def _histogram_gain(old: Samples, new: Samples, name: str) -> list[tuple[float, float]]:
    before = dict(buckets(old, name))
    return [(le, max(0.0, n - before.get(le, 0.0))) for le, n in buckets(new, name)]


def quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding rank q * count."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_le, lower_n = 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if math.isinf(le):
                return lower_le  # beyond the last finite bound: its bound is all we know
            return lower_le + (le - lower_le) * (rank - lower_n) / max(1e-12, n - lower_n)
        lower_le, lower_n = le, n
    return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
