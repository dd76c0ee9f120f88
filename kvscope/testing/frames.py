"""Synthetic engine state for the app's widget tests (real ipc.messages structs)."""
from __future__ import annotations

import time

import numpy as np

from kvscope.ipc import messages as m


def blocks_frame(num_blocks: int = 64, block_size: int = 16,
                 tables: dict[str, list[int]] | None = None,
                 filled: dict[int, int] | None = None, cached: tuple[int, ...] = (),
                 running: tuple[str, ...] | None = None, seq: int = 1,
                 tags: dict[int, int] | None = None,
                 priorities: dict[str, int] | None = None,
                 queue_s: dict[str, float | None] | None = None,
                 wait_reasons: dict[str, str] | None = None,
                 preemptions: list[m.PreemptionEvent] | None = None) -> m.BlocksFrame:
    """tables: request id -> physical blocks; blocks in two tables are shared (ref 2).
    tags: block -> content tag, making the block prefix-cached (hashed); a cached block
    without one gets its own id as its tag. priorities, queue_s, wait_reasons: per request
    id (defaults 0, None, ""); preemptions: since the previous frame (see preemption())."""
    tables = tables or {}
    filled = filled or {}
    tags = {**{b: b for b in cached}, **(tags or {})}
    ids = list(tables)
    owner = np.full(num_blocks, -1, np.int32)
    ref = np.zeros(num_blocks, np.uint16)
    flags = np.full(num_blocks, m.BLOCK_FREE, np.uint8)
    fill = np.zeros(num_blocks, np.uint16)
    for i, rid in enumerate(ids):
        for b in tables[rid]:
            if b < 0:  # freed behind a sliding window: in the table, not in the pool
                continue
            if owner[b] < 0:
                owner[b] = i
            ref[b] += 1
            flags[b] = m.BLOCK_USED
            fill[b] = filled.get(b, block_size)
    for b in cached:
        flags[b] = m.BLOCK_CACHED
        fill[b] = block_size
    for b in tags:
        flags[b] |= m.BLOCK_HAS_HASH
    hash_tags = np.array([tags[b] for b in sorted(tags)], "<u4")
    lens = [len(tables[r]) for r in ids]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype("<i4")
    flat = np.array([b for r in ids for b in tables[r]], "<i4")
    used = int(((flags & m.BLOCK_STATE_MASK) == m.BLOCK_USED).sum())
    running = tuple(ids) if running is None else running
    tokens = [sum(int(fill[b]) for b in tables[r]) for r in ids]
    return m.BlocksFrame(
        seq=seq, time=time.time(), step=seq, num_blocks=num_blocks, block_size=block_size,
        owner=owner.astype("<i4").tobytes(), filled=fill.astype("<u2").tobytes(),
        ref_count=ref.astype("<u2").tobytes(), flags=flags.tobytes(), request_ids=ids,
        request_running=[r in running for r in ids], num_tokens=tokens,
        num_computed_tokens=tokens, table_offsets=offsets.tobytes(), tables=flat.tobytes(),
        hash_tags=hash_tags.tobytes(),
        request_priorities=[(priorities or {}).get(r, 0) for r in ids],
        request_queue_s=[(queue_s or {}).get(r) for r in ids],
        request_wait_reasons=[(wait_reasons or {}).get(r, "") for r in ids],
        preemptions=list(preemptions or ()),
        used=used, free=num_blocks - used - len(cached), cached=len(cached),
        tokens_stored=int(fill.sum()), internal_waste_slots=int(used * block_size - sum(
            int(fill[b]) for b in range(num_blocks)
            if flags[b] & m.BLOCK_STATE_MASK == m.BLOCK_USED)),
        reserved_max_len_blocks=32 * len(ids), reserved_request_blocks=8 * len(ids))


def preemption(request_id: str, block_ids, reason: str = "memory", priority: int = 0,
               step: int = 1) -> m.PreemptionEvent:
    """One preemption as a blocks frame carries it (the victim's freed blocks)."""
    return m.PreemptionEvent(request_id, reason, list(block_ids), priority, step)


def step_frame(seq: int = 1, t: float | None = None, prefill: int = 0, decode: int = 4,
               running: int = 4, waiting: int = 0, budget: int = 512) -> m.StepFrame:
    t = time.time() if t is None else t
    rec = m.StepRecord(seq, t, 0.01, running, prefill, decode, running, waiting)
    extra = {}
    if "num_scheduled_tokens" in m.StepFrame.__struct_fields__:  # newer protocol field
        extra["num_scheduled_tokens"] = prefill + decode
    return m.StepFrame(**extra,
        seq=seq, time=t, step=seq, duration_s=0.01, scheduled=[], batch_size=running,
        num_prefill_tokens=prefill, num_decode_tokens=decode, token_budget=budget,
        num_running=running, num_waiting=waiting, num_preempted=0, preemptions_total=0,
        prompt_tokens_total=0, generated_tokens_total=seq * decode, history=[rec],
        history_dropped_total=0)


def engine_settings(**overrides) -> m.EngineSettings:
    """The config a tiny test engine runs with (EngineConfig's defaults); keywords override."""
    fields = {"model": "/models/tiny", "device": "auto", "dtype": "auto", "weights": "auto",
              "block_size": 16, "kv_dtype": "auto", "kv_rotation": "auto",
              "kv_anchor_tokens": 4, "kv_cache_bytes": 256 * 1024 * 1024, "num_kv_blocks": None,
              "max_num_seqs": 64, "max_num_batched_tokens": 512, "max_model_len": None,
              "enable_prefix_caching": True, "seed": 0}
    return m.EngineSettings(**{**fields, **overrides})


def engine_stats(**overrides) -> m.EngineStats:
    """LLMEngine.stats() of a 64-block float32 pool with one request running; keywords
    override."""
    fields = {"num_kv_blocks": 64, "block_size": 16, "kv_dtype": "float32",
              "kv_rotation": "none", "kv_rotation_matrix": None, "kv_bytes_per_token": 2048,
              "kv_anchor_tokens": 0, "kv_anchor_bytes": 0, "kv_cache_bytes": 64 * 16 * 2048,
              "num_free_blocks": 60, "num_cached_blocks": 0, "num_used_blocks": 4,
              "num_running": 1, "num_waiting": 0, "num_preemptions": 0, "num_steps": 1,
              "num_prompt_tokens": 0, "num_generated_tokens": 0, "prefix_cache_queries": 0,
              "prefix_cache_hits": 0, "max_model_len": 512, "device": "cpu",
              "dtype": "float32", "weights": "dense"}
    return m.EngineStats(**{**fields, **overrides})


def server_counters(**overrides) -> m.ServerCounters:
    fields = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0, "bad_frames": 0,
              "dropped_replies": 0, "http_in_flight": 0, "publish_s": 0.0}
    return m.ServerCounters(**{**fields, **overrides})


def stats_frame(seq: int = 1, t: float | None = None, config: dict | None = None,
                server: dict | None = None, preemptions_by_reason: dict | None = None,
                interrupted_steps: int = 0, **engine) -> m.StatsFrame:
    """config: EngineSettings fields to override; server: ServerCounters fields;
    preemptions_by_reason: the cumulative counts ({"memory": 3}); interrupted_steps: steps
    cut short so far; any other keyword: an EngineStats field (num_kv_blocks=...,
    kv_dtype=...)."""
    t = time.time() if t is None else t
    pct = m.Percentiles(0.05, 0.08, 0.1, 10)
    stats = engine_stats(**engine)
    return m.StatsFrame(
        seq=seq, time=t, step=seq, uptime_s=10.0, window_s=5.0, prompt_tokens_per_s=100.0,
        generation_tokens_per_s=50.0, ttft_s=pct, itl_s=pct,
        kv_usage=stats.num_used_blocks / max(1, stats.num_kv_blocks), engine=stats,
        config=engine_settings(**(config or {})), server=server_counters(**(server or {})),
        preemptions_by_reason=dict(preemptions_by_reason or {}),
        interrupted_steps=interrupted_steps)


def heartbeat(seq: int = 1, busy: bool = False) -> m.Heartbeat:
    return m.Heartbeat(seq=seq, time=time.time(), step=seq, uptime_s=1.0, pid=1234,
                       busy=busy, bad_frames=0)
