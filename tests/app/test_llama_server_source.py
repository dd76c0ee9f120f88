"""llama-server as a source, without Qt: its payloads (the fixtures hold its real shapes) ->
slots, settings and plot samples; the source against a fake server that turns its endpoints
off, sends garbage, stalls, goes away and comes back; and the probe that tells engines apart."""
from __future__ import annotations

import json
import time

import pytest

from kvscope.app.sources.http_get import BadPayload
from kvscope.app.sources.llama_server_payloads import (
    metrics_sample,
    parse_props,
    parse_slots,
    slots_disabled,
)
from kvscope.app.sources.llama_server_source import LlamaServerSource
from kvscope.app.sources.probe import ProbeError, probe
from kvscope.app.vllm import prometheus_text
from tests.app.fake_llama_server import METRICS, NO_SLOTS, PROPS, SLOTS, FakeLlamaServer
from tests.app.fake_vllm import FakeVllmHttp


def test_slots_fixture_makes_one_row_per_slot():
    frame = parse_slots(SLOTS, now=5.0)
    assert [s.id for s in frame.slots] == [0, 1, 2, 3]
    busy, idle, full, unused = frame.slots
    assert (busy.n_used, busy.n_ctx, busy.task, busy.processing) == (1536, 4096, 12, True)
    assert (busy.n_decoded, busy.n_remain) == (41, 215)
    assert (idle.task, idle.processing, idle.n_used) == (7, False, 700)  # its last task's KV
    assert full.n_used == 3900
    assert (unused.task, unused.n_used) == (None, 0)  # never had a task: an empty KV


def test_an_old_server_without_n_prompt_tokens_leaves_the_fill_unknown():
    old = [{k: v for k, v in SLOTS[0].items() if k != "n_prompt_tokens"}]
    assert parse_slots(old).slots[0].n_used is None


@pytest.mark.parametrize("body, field", [
    ({"slots": []}, "not a list"), ([1], "not an object"), ([{"id": "0", "n_ctx": 1}], ".id"),
    ([{"id": 0, "n_ctx": None}], "n_ctx"), ([{"id": 0, "n_ctx": 9, "id_task": 1.5}], "id_task"),
    ([{"id": 0, "n_ctx": 9, "n_prompt_tokens": True}], "n_prompt_tokens")])
def test_malformed_slots_name_what_is_wrong(body, field):
    with pytest.raises(BadPayload, match=field.replace(".", r"\.")):
        parse_slots(body)


def test_slots_disabled_says_how_to_enable_it():
    text = slots_disabled(501, json.dumps(NO_SLOTS).encode())
    assert "--no-slots" in text and "--slots" in text
    assert slots_disabled(200, b"[]") is None
    assert "HTTP 500" in slots_disabled(500, b"boom")


def test_props_fixture():
    p = parse_props(PROPS)
    assert (p.total_slots, p.n_ctx, p.model) == (4, 4096, "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert p.kv_unified is None  # llama-server's /props has no such field: not reported
    assert parse_props({**PROPS, "kv_unified": True}).kv_unified is True
    with pytest.raises(BadPayload, match="total_slots"):
        parse_props({"total_slots": "four"})


def test_two_scrapes_make_rates_and_queues():
    old, new = (prometheus_text.parse(t) for t in METRICS)
    s = metrics_sample(old, new, 100.0, 102.0)
    assert s.prompt_tokens_per_s == pytest.approx((9000 - 5000) / 2)
    assert s.generation_tokens_per_s == pytest.approx((1800 - 1000) / 2)
    assert (s.processing, s.deferred, s.decodes) == (3, 2, 400)
    assert s.prompt_tokens_per_decode == pytest.approx(4000 / 400)
    assert s.generation_tokens_per_decode == pytest.approx(800 / 400)
    with pytest.raises(BadPayload, match="llamacpp"):
        metrics_sample(old, prometheus_text.parse("other_metric 1\n"), 0, 1)


def take_until(source, done, timeout: float = 20.0):
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        got.append(source.take())
        if done(got):
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out: {got[-3:]}")


@pytest.fixture
def fake():
    server = FakeLlamaServer()
    yield server
    server.stop()


def running(fake, **kw):
    source = LlamaServerSource(fake.url, poll_interval_s=0.1, **kw)
    source.start()
    return source


def test_the_source_reads_a_llama_server(fake):
    source = running(fake)
    try:
        got = take_until(source, lambda us: any(u.stats for u in us)
                         and any(u.slots for u in us) and any(u.settings for u in us))
        slots = [u.slots for u in got if u.slots][-1]
        assert [s.n_used for s in slots.slots] == [1536, 700, 3900, 0]
        settings = [u.settings for u in got if u.settings][-1]
        assert settings["total_slots"] == "4" and settings["n_ctx"] == "4096"
        assert "not reported by llama-server" in settings["kv_unified"]
        stats = next(s for u in got for s in u.stats)
        assert stats.prompt_tokens_per_s > 0 and stats.kv_usage is None  # no KV usage: None
        step = next(s for u in got for s in u.steps).history[0]
        assert (step.num_running, step.num_waiting) == (3, 2)
        assert "4 slots × 4096 tokens" in [u.facts for u in got if u.facts][-1]
        assert source.counts().bad == 0
    finally:
        source.stop()


def test_slots_and_metrics_turned_off_are_said_with_how_to_enable_them():
    fake = FakeLlamaServer(slots_enabled=False, metrics_enabled=False)
    source = running(fake)
    try:
        got = take_until(source, lambda us: any(u.slots for u in us)
                         and any(u.notice for u in us))
        assert "--slots" in [u.slots for u in got if u.slots][-1].disabled
        assert "--metrics" in [u.notice for u in got if u.notice][-1]
        assert not any(u.error for u in got)  # off is not dead
    finally:
        source.stop()
        fake.stop()


@pytest.mark.parametrize("bad", ["slots", "metrics", "props"])
def test_malformed_payloads_are_counted_and_named(fake, bad):
    fake.bad = bad
    source = running(fake)
    try:
        got = take_until(source, lambda us: source.counts().bad >= 2)
        assert f"/{bad}" in [u.bad for u in got if u.bad][-1]
        assert source._thread.is_alive() and not any(u.error for u in got)
        fake.bad = None  # it recovers on the next good payload
        if bad == "slots":
            take_until(source, lambda us: any(u.slots and u.slots.slots for u in us))
    finally:
        source.stop()


def test_a_server_that_goes_away_is_dead_then_recovers(fake):
    source = running(fake, timeout_s=0.5)
    try:
        take_until(source, lambda us: any(u.scraped_ok for u in us))
        fake.stop()
        got = take_until(source, lambda us: us[-1].error is not None)
        assert f"127.0.0.1:{fake.port}/health" in got[-1].error
        fake.start()  # the same port again
        take_until(source, lambda us: us[-1].error is None and us[-1].scraped_ok)
    finally:
        source.stop()


def test_a_stalled_server_times_out_instead_of_hanging(fake):
    fake.delay_s = 3.0
    source = running(fake, timeout_s=0.3)
    try:
        started = time.monotonic()
        got = take_until(source, lambda us: us[-1].error is not None, timeout=10)
        assert time.monotonic() - started < 2.5 and "timed out" in got[-1].error
    finally:
        fake.delay_s = 0.0
        source.stop()


def test_the_probe_tells_the_engines_apart(fake):
    assert probe(fake.url) == "llama-server"
    vllm = FakeVllmHttp()
    try:
        assert probe(vllm.url) == "vllm"  # no /version in the fake: its vllm: metrics tell
    finally:
        vllm.stop()
    assert probe("tcp://127.0.0.1:5570") == "kvscope"
    with pytest.raises(ProbeError, match="--engine"):
        probe("http://127.0.0.1:9", timeout=0.5)
    with pytest.raises(ProbeError, match="tcp://"):
        probe("ftp://x")


def test_the_mailbox_keeps_the_newest_state_and_counts_what_it_replaced():
    from kvscope.app.sources.source import MAX_FRAMES, SourceMailbox

    box = SourceMailbox()
    box.post(facts="a", steps=[1])
    box.post(facts="b", steps=[2])  # "a" is never shown: coalesced
    u = box.take()
    assert (u.facts, u.steps) == ("b", [1, 2])
    c = box.counts()
    assert (c.received, c.shown, c.coalesced) == (4, 3, 1)
    box.post(error="gone")
    assert box.take().error == box.take().error == "gone"  # DEAD stays until it answers
    box.post(steps=list(range(MAX_FRAMES + 5)))  # a window that stopped taking
    assert len(box.take().steps) == MAX_FRAMES and box.counts().coalesced == 1 + 5
    box.count_bad("/slots: junk")
    assert box.take().bad == "/slots: junk" and box.counts().bad == 1


def test_captured_payloads_of_a_real_llama_server_parse():
    """tests/fixtures/llama_server_captured_*: a real llama-server (llama.cpp of
    llama-cpp-python 0.3.36, -np 4 -c 8192 --metrics) on the embedded GGUF, 3 chats running."""
    from tests.app.fake_llama_server import FIXTURES

    slots = parse_slots(json.loads((FIXTURES / "llama_server_captured_slots.json").read_text()))
    assert [s.n_ctx for s in slots.slots] == [2048] * 4  # 8192 split over 4 slots
    busy = [s for s in slots.slots if s.processing]
    assert len(busy) == 3 and all(s.n_used and s.task is not None for s in busy)
    props = parse_props(json.loads((FIXTURES / "llama_server_captured_props.json").read_text()))
    assert (props.total_slots, props.n_ctx, props.kv_unified) == (4, 2048, None)
    text = (FIXTURES / "llama_server_captured_metrics.txt").read_text()
    metrics = prometheus_text.parse(text)
    s = metrics_sample(metrics, metrics, 0.0, 1.0)
    assert (s.processing, s.deferred) == (3, 0)


def test_the_generation_rate_follows_the_slots_between_polls():
    from kvscope.app.sources.source import SlotsFrame, SlotState

    source = LlamaServerSource("http://127.0.0.1:9")

    def frame(t, decoded):
        return SlotsFrame(t, tuple(SlotState(i, 100, 10, 7 + i, True, n)
                                   for i, n in enumerate(decoded)))
    assert source._slot_rate(frame(10.0, [5, 8])) is None  # the first poll: no interval yet
    assert source._slot_rate(frame(12.0, [9, 14])) == pytest.approx((4 + 6) / 2)
