"""State-stream payloads (step, blocks, stats, heartbeat) built from an LLMEngine.

Everything here runs on the engine thread between steps, so it reads a consistent engine and
must stay cheap: the blocks payload is built from the free lists and the block tables with
numpy instead of walking every Block object (32k blocks in well under a millisecond or two).
"""
from __future__ import annotations

import itertools
import math
import os
import time
from collections import deque

import msgspec
import numpy as np

from kvscope.engine.scheduling.scheduler import ScheduledSeq
from kvscope.ipc import messages as m

STEP_HISTORY = 512  # steps kept between two step frames; older ones are counted as dropped
PREEMPTION_BACKLOG = 256  # preemptions kept between two blocks frames; older ones fall off
LATENCY_SAMPLES = 2048  # recent TTFT / inter-token samples behind the percentiles
RATE_WINDOW_S = 5.0


def engine_settings(engine) -> m.EngineSettings:
    """The config in force as the wire carries it, with the model's decode-path notice."""
    # Here, not at the top: this module stays torch-free to import (the engine has torch).
    from kvscope.engine.model.fused.model_view import decode_path_notice

    return msgspec.structs.replace(engine.config.settings(), decode_path_notice=(
        decode_path_notice(getattr(engine, "model", None))))


class StepLog:
    """What each step did, recorded right after it ran."""

    def __init__(self) -> None:
        self.history: deque[m.StepRecord] = deque()
        self.history_dropped = 0
        self.latest: tuple[float, float, list[m.ScheduledItem]] | None = None
        self.expert_load: list[int] | None = None  # the latest step's, a mixture of experts
        # The scheduler clears its last_preemptions every step; frames are rarer than steps.
        self.preemptions: deque[m.PreemptionEvent] = deque(maxlen=PREEMPTION_BACKLOG)

    def record(self, engine, scheduled: list[ScheduledSeq], streamed: dict[str, int],
               duration_s: float) -> None:
        """scheduled: the step's batch (StepResult.scheduled). streamed: output tokens each
        request had streamed before this step, which tells a decode (one token after its own
        last one) from prefill or recompute work."""
        items = [m.ScheduledItem(s.seq.request_id, s.num_tokens,
                                 s.num_tokens - s.num_draft_tokens == 1  # drafts verify a decode
                                 and streamed.get(s.seq.request_id, 0) > 0)
                 for s in scheduled]
        decode = sum(1 for i in items if i.is_decode)
        now = time.time()
        self.latest = (now, duration_s, items)
        # Tokens per expert in this step (engine.model.moe.ExpertLoad; None: a dense model).
        load = getattr(getattr(engine, "model", None), "expert_load", None)
        self.expert_load = None if load is None else load.last_step()
        sched = engine.scheduler
        self.history.append(m.StepRecord(
            engine.num_steps, now, duration_s, len(items),
            sum(i.num_tokens for i in items) - decode, decode,
            len(sched.running), len(sched.waiting)))
        if len(self.history) > STEP_HISTORY:
            self.history.popleft()
            self.history_dropped += 1
        self.preemptions.extend(
            m.PreemptionEvent(p.request_id, p.reason, [int(b) for b in p.block_ids],
                              int(getattr(p, "priority", 0)), engine.num_steps)
            for p in getattr(sched, "last_preemptions", ()))

    def take_preemptions(self, consume: bool = True) -> list[m.PreemptionEvent]:
        """The preemptions since the last blocks frame (consume=False: a snapshot reply,
        which leaves them to the next published frame)."""
        out = list(self.preemptions)
        if consume:
            self.preemptions.clear()
        return out

    def frame(self, engine, seq: int, consume: bool = True) -> m.StepFrame | None:
        """consume=False (a snapshot reply) leaves the history to the next published frame."""
        if self.latest is None:
            return None
        t, duration, items = self.latest
        sched = engine.scheduler
        decode = sum(1 for i in items if i.is_decode)
        history = list(self.history)
        if consume:
            self.history.clear()
        return m.StepFrame(
            seq=seq, time=t, step=engine.num_steps, duration_s=duration, scheduled=items,
            batch_size=len(items), num_prefill_tokens=sum(i.num_tokens for i in items) - decode,
            num_decode_tokens=decode, num_scheduled_tokens=sum(i.num_tokens for i in items),
            token_budget=engine.config.max_num_batched_tokens,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_preempted=sum(1 for s in sched.waiting if s.num_preemptions),
            preemptions_total=sched.num_preemptions,
            prompt_tokens_total=engine.num_prompt_tokens,
            generated_tokens_total=engine.num_generated_tokens,
            history=history, history_dropped_total=self.history_dropped,
            expert_load=self.expert_load,
            step_path=engine.runner.last_path.label)


def blocks_frame(engine, seq: int, sources: dict[str, str] | None = None,
                 preemptions: list[m.PreemptionEvent] | None = None) -> m.BlocksFrame:
    """sources: request id -> where it came from, for requests not sent over ZeroMQ.
    preemptions: those since the previous frame (StepLog.take_preemptions)."""
    bm, sched = engine.block_manager, engine.scheduler
    n, bs = bm.num_blocks, bm.block_size
    live = list(sched.running) + list(sched.waiting)
    lens, offsets, flat = _tables(live)
    held = flat[flat >= 0]  # a -1 entry (freed behind a sliding window) is no block
    flags = _block_flags(bm, held)
    owner = np.full(n, -1, np.int32)
    # Fancy assignment keeps the last write: reversed, the first (oldest) holder wins.
    holders = np.repeat(np.arange(len(live), dtype=np.int32), lens)[flat >= 0]
    owner[held[::-1]] = holders[::-1]
    filled = _filled(live, lens, offsets, flat, n, bs, flags)
    arrays = {"owner": owner, "filled": filled, "ref_count": np.bincount(held, minlength=n),
              "flags": flags, "table_offsets": offsets, "tables": flat}
    packed = {name: _narrow(a) for name, a in arrays.items()}
    # Tags use all 32 bits, so narrowing would never pick a smaller type.
    packed["hash_tags"] = (_hash_tags(bm), "<u4")
    running = len(sched.running)
    return m.BlocksFrame(
        seq=seq, time=time.time(), step=engine.num_steps, num_blocks=n, block_size=bs,
        **{name: data for name, (data, _) in packed.items()},
        dtypes={name: dtype for name, (_, dtype) in packed.items()},
        request_ids=[s.request_id for s in live],
        request_running=[True] * running + [False] * (len(live) - running),
        num_tokens=[s.num_tokens for s in live],
        num_computed_tokens=[s.num_computed_tokens for s in live],
        request_sources=dict(sources or {}),
        **_request_waits(live), preemptions=list(preemptions or ()),
        rolled_back_blocks=_rolled_back(engine),
        **_tier_counts(bm), **_totals(engine, flags, filled))


def _tier_counts(bm) -> dict[str, int]:
    """The KV tiers beside the pool (issue 56): nothing when there are none."""
    if bm.tiers is None:
        return {}
    f = bm.tiers.stats_fields()
    return {"tier_host_blocks": f["kv_host_blocks"],
            "tier_host_capacity_blocks": f["kv_host_capacity_blocks"],
            "tier_disk_blocks": f["kv_disk_blocks"], "tier_disk_bytes": f["kv_disk_bytes"]}


def _rolled_back(engine) -> list[int]:
    """Blocks with draft slots rolled back since the last frame (engine.spec_decode.decoder)."""
    spec = getattr(engine, "spec", None)
    return spec.take_rolled_back() if spec is not None else []


def _request_waits(live) -> dict[str, list]:
    """Per live request: priority, queue time (None while never scheduled), wait reason."""
    return {
        "request_priorities": [int(getattr(s.params, "priority", 0)) for s in live],
        "request_queue_s": [None if s.first_scheduled_time is None
                            else s.first_scheduled_time - s.arrival_time for s in live],
        "request_wait_reasons": [s.wait_reason for s in live]}


def block_totals(engine) -> dict[str, int]:
    """The blocks frame's totals (used, cached, waste, ...) without its per-block arrays."""
    bm, sched = engine.block_manager, engine.scheduler
    live = list(sched.running) + list(sched.waiting)
    lens, offsets, flat = _tables(live)
    flags = _block_flags(bm, flat[flat >= 0])
    return _totals(engine, flags,
                   _filled(live, lens, offsets, flat, bm.num_blocks, bm.block_size, flags))


def _tables(live) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block-table lengths, CSR offsets and the tables concatenated (C-speed iteration); the
    tables keep their -1 entries, so an entry's index stays its logical block."""
    lens = np.fromiter((len(s.block_table) for s in live), np.int64, len(live))
    offsets = np.zeros(len(live) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(s.block_table for s in live),
                       np.int64, int(offsets[-1]))
    return lens, offsets, flat


def _totals(engine, flags: np.ndarray, filled: np.ndarray) -> dict[str, int]:
    bm, running = engine.block_manager, engine.scheduler.running
    bs, max_len = bm.block_size, engine.max_model_len
    used_mask = (flags & m.BLOCK_STATE_MASK) == m.BLOCK_USED
    used, cached = int(np.count_nonzero(used_mask)), bm.num_cached_free_blocks
    return {
        "used": used, "free": bm.num_blocks - used - cached, "cached": cached,
        "tokens_stored": int(filled.sum(dtype=np.int64)),
        "internal_waste_slots": used * bs - int(filled[used_mask].sum(dtype=np.int64)),
        # What a cache without paging would hold: a contiguous max-length slab per request.
        "reserved_max_len_blocks": -(-max_len // bs) * len(running),
        "reserved_request_blocks": sum(
            -(-min(s.num_prompt_tokens + s.params.max_tokens, max_len) // bs)
            for s in running)}


_NARROW = ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4")


def _narrow(a: np.ndarray) -> tuple[bytes, str]:
    """Raw bytes in the narrowest integer dtype holding every value (block ids < 65536 take
    two bytes, owners and fill counts usually one), so a 32k-block frame stays ~200 KiB."""
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    for dtype in _NARROW:
        info = np.iinfo(np.dtype(dtype))
        if info.min <= lo and hi <= info.max:
            return a.astype(dtype, copy=False).tobytes(), dtype
    raise ValueError(f"values {lo}..{hi} do not fit in 32 bits")


def _block_flags(bm, flat: np.ndarray) -> np.ndarray:
    """Used = held by a live request's table, cached = in the prefix-cache free list, the rest
    free: no walk over the (possibly 32k long) free list."""
    flags = np.full(bm.num_blocks, m.BLOCK_FREE, np.uint8)
    flags[np.fromiter(bm.cached_free, np.int64, len(bm.cached_free))] = m.BLOCK_CACHED
    flags[flat] = m.BLOCK_USED
    # A block carries a hash exactly when the prefix-cache map points at it.
    hashed = np.fromiter(bm.hash_to_block.values(), np.int64, len(bm.hash_to_block))
    flags[hashed] |= m.BLOCK_HAS_HASH
    return flags


def _hash_tags(bm) -> bytes:
    """Low 32 bits of each registered hash, ordered by block id: the order in which the
    frame's BLOCK_HAS_HASH flags list the hashed blocks (_block_flags sets them from the same
    map), so the receiver lines them up without block ids on the wire."""
    count = len(bm.hash_to_block)
    blocks = np.fromiter(bm.hash_to_block.values(), np.int64, count)
    # Python hashes are signed 64-bit; masking keeps the low 32 bits of either sign.
    tags = np.fromiter(bm.hash_to_block.keys(), np.int64, count) & 0xFFFFFFFF
    return tags[np.argsort(blocks)].astype("<u4").tobytes()


def _filled(live, lens, offsets, flat, n, bs, flags) -> np.ndarray:
    """Tokens written per block: a request's blocks are full up to its computed tokens."""
    filled = np.zeros(n, np.int64)
    computed = np.fromiter((s.num_computed_tokens for s in live), np.int64, len(live))
    position = np.arange(len(flat)) - np.repeat(offsets[:-1], lens)
    per_entry = np.clip(np.repeat(computed, lens) - position * bs, 0, bs)
    # A shared block is a full prefix block for every holder, so any holder's view will do.
    held = flat >= 0
    filled[flat[held]] = per_entry[held]
    # Cached-free blocks were registered full; that is what makes them reusable.
    filled[(flags & m.BLOCK_STATE_MASK) == m.BLOCK_CACHED] = bs
    return filled


class Metrics:
    """Latency samples and token-rate windows behind the stats frame."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.ttft: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.itl: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.last_token_at: dict[str, float] = {}
        self.totals: deque[tuple[float, int, int]] = deque()

    def on_tokens(self, seq, now: float) -> tuple[str, float] | None:
        """A delta with tokens for seq arrived at monotonic time now. Returns the latency
        sample it made, ("ttft" | "itl", seconds), for other observers (/metrics)."""
        rid = seq.request_id
        last = self.last_token_at.get(rid)
        self.last_token_at[rid] = now
        if last is not None:
            self.itl.append(now - last)
            return "itl", now - last
        if seq.first_token_time is None:
            return None
        self.ttft.append(seq.first_token_time - seq.arrival_time)
        return "ttft", seq.first_token_time - seq.arrival_time

    def forget(self, request_id: str) -> None:
        self.last_token_at.pop(request_id, None)

    def frame(self, engine, seq: int, server: m.ServerCounters) -> m.StatsFrame:
        now = time.monotonic()
        self.totals.append((now, engine.num_prompt_tokens, engine.num_generated_tokens))
        while len(self.totals) > 2 and now - self.totals[1][0] >= RATE_WINDOW_S:
            self.totals.popleft()
        t0, p0, g0 = self.totals[0]
        span = now - t0
        stats = engine.stats()
        return m.StatsFrame(
            seq=seq, time=time.time(), step=engine.num_steps, uptime_s=now - self.started,
            window_s=span,
            prompt_tokens_per_s=(engine.num_prompt_tokens - p0) / span if span > 0 else 0.0,
            generation_tokens_per_s=(engine.num_generated_tokens - g0) / span
            if span > 0 else 0.0,
            ttft_s=percentiles(self.ttft), itl_s=percentiles(self.itl),
            kv_usage=stats.num_used_blocks / max(1, stats.num_kv_blocks),
            engine=stats, config=engine_settings(engine), server=server,
            preemptions_by_reason={str(k): int(v) for k, v in getattr(
                engine.scheduler, "preemptions_by_reason", {}).items()},
            recomputed_tokens=int(getattr(engine.scheduler, "recomputed_tokens", 0)),
            interrupted_steps=engine.interrupt.num_interrupted)


def percentiles(samples) -> m.Percentiles:
    """Nearest-rank percentiles via one partial sort (np.percentile costs ~10x more)."""
    n = len(samples)
    if not n:
        return m.Percentiles(None, None, None, 0)
    ranks = [max(0, math.ceil(q * n) - 1) for q in (0.5, 0.9, 0.99)]
    a = np.partition(np.fromiter(samples, np.float64, n), ranks)
    return m.Percentiles(*(float(a[r]) for r in ranks), n)


def heartbeat(seq: int, step: int, started: float, busy: bool, bad_frames: int) -> m.Heartbeat:
    return m.Heartbeat(seq=seq, time=time.time(), step=step,
                       uptime_s=time.monotonic() - started, pid=os.getpid(), busy=busy,
                       bad_frames=bad_frames)
