"""The window's vLLM side without Qt: /metrics fixtures -> plot samples, vLLM KV events ->
the prefix-cache map, the OpenAI chat client, and the source against a fake vLLM and against
kvscope itself."""
from __future__ import annotations

import time

import msgspec
import pytest

from kvscope.app.sources.vllm_source import VllmSource, VllmTarget
from kvscope.app.vllm import prometheus_text
from kvscope.app.vllm.openai_chat import OpenAIChat, OpenAIError
from kvscope.app.vllm.prefix_cache import PrefixCache
from kvscope.app.vllm.server_sample import quantile, sample
from kvscope.ipc import vllm_kv_events as v
from tests.app.fake_vllm import METRICS, REPLY, SCRIPT, FakeKvEvents, FakeVllmHttp, h


def test_two_recorded_scrapes_make_a_sample():
    old, new = (prometheus_text.parse(t) for t in METRICS)
    s = sample(old, new, 100.0, 104.0)
    assert (s.running, s.waiting, s.kv_usage, s.preemptions) == (31, 7, 0.874, 3)
    assert s.prompt_tokens_per_s == pytest.approx((61600 - 52000) / 4)
    assert s.generation_tokens_per_s == pytest.approx((22500 - 18000) / 4)
    assert s.prefix_hit_rate == pytest.approx((25600 - 20800) / (61600 - 52000))
    # The interval's 40 new first tokens: 20 at 0.09 s (bucket 0.08..0.1), 20 at 0.7 s
    # (bucket 0.5..0.75): the median is the top of the first bucket, p90 inside the second.
    assert s.ttft_p50_s == pytest.approx(0.1)
    assert s.ttft_p90_s == pytest.approx(0.5 + 0.25 * (36 - 20) / 20)
    # 4000 new inter-token gaps at 0.02 s (bucket 0.01..0.025) and 500 at 0.045 s (0.025..0.05)
    assert s.itl_p50_s == pytest.approx(0.01 + 0.015 * 2250 / 4000)
    assert s.itl_p90_s == pytest.approx(0.025 + 0.025 * (4050 - 4000) / 500)
    assert s.steps == 2500 - 2000  # vllm:iteration_tokens_total's count
    assert (s.block_size, s.num_blocks) == (16, 27153)
    assert s.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert s.cache_config["cache_dtype"] == "auto"


def test_quantile_edges():
    assert quantile([], 0.5) is None
    assert quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([(1.0, 0.0), (float("inf"), 4.0)], 0.5) == 1.0  # all beyond the last bound


@pytest.mark.parametrize("text", ['vllm:x{a="b} 1\n', "vllm:x abc\n", "x" * (17 << 20)])
def test_bad_metrics_text_is_a_clear_error(text):
    with pytest.raises(prometheus_text.MetricsError, match="/metrics"):
        prometheus_text.parse(text)


def batch(events) -> v.KVEventBatch:
    return v.decode_batch(msgspec.msgpack.encode([1.0, events, 0]))


def test_the_prefix_cache_follows_the_events():
    cache = PrefixCache()
    for events in SCRIPT:
        cache.apply(batch(events))
    snap = cache.snapshot()
    # h1-h2 is a chain with two branches (h3, evicted; h4-h5); h6 a chain of its own.
    assert set(cache.blocks) == {h(1), h(2), h(4), h(5), h(6)}
    assert cache.blocks[h(5)].depth == 3 and cache.blocks[h(5)].root == h(1)
    assert (snap.num_blocks, snap.num_chains, snap.longest_chain) == (5, 2, 4)
    assert snap.num_tokens == 5 * 16 and snap.block_size == 16
    assert (snap.stored_total, snap.removed_total, snap.unknown_removed) == (6, 1, 0)
    # A block whose parent was stored before the window attached, then everything cleared.
    cache.apply(batch([{"type": "BlockStored", "block_hashes": [77], "parent_block_hash": 76,
                        "token_ids": [1] * 16, "block_size": 16, "lora_id": None,
                        "medium": "GPU", "lora_name": None},
                       {"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU"}]))
    assert cache.blocks[77].root == 76 and cache.blocks[77].depth == 1
    assert cache.snapshot().unknown_removed == 1
    cache.apply(batch([{"type": "AllBlocksCleared"}]))
    assert cache.snapshot().num_blocks == 0 and cache.cleared_total == 1


@pytest.fixture(scope="module")
def fake_http():
    server = FakeVllmHttp()
    yield server
    server.stop()


def test_openai_chat_streams_from_any_compatible_server(fake_http):
    client = OpenAIChat(fake_http.url)
    model = client.models()[0]
    pieces = list(client.stream_chat([{"role": "user", "content": "hi"}], model, max_tokens=9))
    assert pieces == REPLY
    sent = fake_http.chats[-1]
    assert sent["stream"] is True and sent["max_tokens"] == 9 and sent["model"] == model


def test_openai_errors_say_what_failed(fake_http):
    with pytest.raises(OpenAIError, match="HTTP 404"):
        OpenAIChat(fake_http.url + "/nope").models()
    with pytest.raises(OpenAIError, match="127.0.0.1:9"):
        OpenAIChat("http://127.0.0.1:9", timeout=2).models()


def take_until(source: VllmSource, done, timeout: float = 30.0):
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        got.append(source.take())
        if done(got):
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out: {got[-3:]}")


def test_source_against_a_fake_vllm(fake_http):
    events = FakeKvEvents()
    source = VllmSource(VllmTarget(fake_http.url, events.endpoint, events.replay_endpoint),
                        scrape_interval_s=0.2)
    source.start()
    try:
        def done(updates):
            cache = [u.cache for u in updates if u.cache is not None]
            return any(u.samples for u in updates) and cache and cache[-1].stored_total == 6
        updates = take_until(source, done)
        s = next(x for u in updates for x in u.samples)
        assert s.running is not None and s.block_size == 16
        cache = [u.cache for u in updates if u.cache is not None][-1]
        assert cache.num_blocks == 5 and cache.removed_total == 1
        counters = [u.events for u in updates if u.events is not None][-1]
        assert counters.bad == 0 and counters.missed == 0
    finally:
        source.stop()
        events.stop()


def test_source_reports_an_unreachable_server():
    source = VllmSource(VllmTarget("http://127.0.0.1:9"), scrape_interval_s=0.2)
    source.start()
    try:
        updates = take_until(source, lambda us: any(u.error for u in us))
        assert "127.0.0.1:9/metrics" in next(u.error for u in updates if u.error)
    finally:
        source.stop()
