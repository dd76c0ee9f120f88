"""`kvscope serve --kv-events ... --metrics-prefix vllm`: a real server's KV events and
/metrics, read as a vLLM client would read them."""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from kvscope.ipc import vllm_kv_events as v
from kvscope.ipc.vllm_kv_subscriber import KVEventSubscriber
from tests.support.server_harness import Server, save_chat_model

ARGS = ["--block-size", "4", "--num-kv-blocks", "64", "--metrics-port", "0",
        "--metrics-prefix", "vllm", "--kv-events", "tcp://127.0.0.1:0",
        "--kv-events-replay", "tcp://127.0.0.1:0", "--kv-events-topic", "kv"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_chat_model(tmp_path_factory.mktemp("chat"), seed=2)
    server = Server(model, tmp_path_factory.mktemp("serve") / "serve.log", *ARGS)
    yield server
    server.stop()


def kv_endpoints(server) -> tuple[str, str]:
    found = re.search(r"KV events \(vLLM format\) on (\S+), replay on (\S+), topic 'kv'",
                      server.log_text())
    assert found, server.log_text()
    return found.group(1).rstrip(","), found.group(2).rstrip(",")


def collect(sub: KVEventSubscriber, until, timeout: float = 60.0) -> list:
    events, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, batch in sub.poll(100):
            events += batch.events
        if until(events):
            return events
    raise AssertionError(f"timed out; got {events}")


def test_a_prompts_full_blocks_are_stored_then_cleared_on_reconfigure(server, client):
    sub = KVEventSubscriber(*kv_endpoints(server), topic="kv")
    try:
        time.sleep(0.5)  # let the SUB connect (a late joiner would replay, tested below)
        prompt = list(range(40, 50))  # 10 tokens: two full blocks of 4
        client.generate(prompt, {"max_tokens": 1}, timeout=120)
        events = collect(sub, lambda ev: any(isinstance(e, v.BlockStored) for e in ev))
        stored = next(e for e in events if isinstance(e, v.BlockStored))
        assert stored.parent_block_hash is None and len(stored.block_hashes) == 2
        assert stored.token_ids == prompt[:8] and stored.block_size == 4
        assert stored.medium == "CPU"
        # The same prefix again: a hit, so the cache gains nothing for those blocks.
        client.generate(prompt[:9], {"max_tokens": 1}, timeout=120)
        client.reconfigure(block_size=8, timeout=120)
        events = collect(sub, lambda ev: any(isinstance(e, v.AllBlocksCleared) for e in ev))
        assert not [e for e in events if isinstance(e, v.BlockStored)
                    and e.block_hashes[0] == stored.block_hashes[0]]
        # The rebuilt pool lost the prompt's blocks: removed, then everything cleared.
        removed = {h for e in events if isinstance(e, v.BlockRemoved) for h in e.block_hashes}
        assert set(stored.block_hashes) <= removed
        assert isinstance(events[-1], v.AllBlocksCleared)
        # A late subscriber gets the same batches from the replay endpoint.
        late = KVEventSubscriber(*kv_endpoints(server), topic="kv")
        try:
            replayed = [b for _, b in late.replay_from(0)]
            flat = [e for b in replayed for e in b.events]
            assert stored in flat and any(isinstance(e, v.AllBlocksCleared) for e in flat)
        finally:
            late.close()
        assert sub.counters.bad == 0
    finally:
        sub.close()


def test_metrics_carry_vllms_prefix(client, server):
    url = client.hello(timeout=60).metrics_url
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert "vllm:num_requests_running{" in text and "vllm:kv_cache_usage_perc{" in text
    assert "vllm:prefix_cache_hits_total{" in text
    assert "kvscope:" not in text
    # Its own request (not an earlier test's: make check may run this test alone), then the
    # counters once the events are published.
    client.generate(list(range(40, 58)), {"max_tokens": 2}, timeout=120)
    deadline = time.monotonic() + 30
    kv_events = client.snapshot(timeout=60).stats.server.kv_events
    while kv_events is not None and kv_events.batches < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        kv_events = client.snapshot(timeout=60).stats.server.kv_events
    assert kv_events is not None and kv_events.batches >= 1 and kv_events.batches_dropped == 0


def test_the_vllm_window_source_reads_kvscope_itself(server, client):
    """`kvscope --attach-vllm` pointed at kvscope serve --metrics-prefix vllm --kv-events."""
    from kvscope.app.sources.vllm_source import VllmSource, VllmTarget

    hello = client.hello(timeout=60)
    url, block_size = hello.metrics_url.removesuffix("/metrics"), hello.config.block_size
    source = VllmSource(VllmTarget(url, *kv_endpoints(server), topic="kv"),
                        scrape_interval_s=0.2)
    source.start()
    try:
        client.generate(list(range(60, 75)), {"max_tokens": 2}, timeout=120)
        samples, cache, deadline = [], None, time.monotonic() + 60
        while time.monotonic() < deadline and not (samples and cache and cache.num_blocks):
            update = source.take()
            samples += update.samples
            cache = update.cache or cache
            time.sleep(0.05)
        assert samples and samples[-1].running is not None and samples[-1].kv_usage is not None
        assert samples[-1].block_size == block_size  # from vllm:cache_config_info
        assert cache is not None and cache.num_blocks >= 1 and cache.block_size == block_size
        assert cache.mediums == ("CPU",)
    finally:
        source.stop()
