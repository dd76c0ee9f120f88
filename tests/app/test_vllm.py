"""`kvscope --attach-vllm` (= `--attach URL --engine vllm`): the window over a fake vLLM made
of vLLM's real formats (recorded /metrics text, hand-built KV-event msgpack with replay, an
OpenAI streaming chat), drawn by the same views as every source (app.source_window)."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from kvscope.app.source_window import SourceWindow
from kvscope.app.sources.vllm_source import VllmSource, VllmTarget
from tests.app.fake_vllm import REPLY, FakeKvEvents, FakeVllmHttp


@pytest.fixture
def fake():
    http, events = FakeVllmHttp(), FakeKvEvents()
    yield http, events
    events.stop()
    http.stop()


def vllm_window(qtbot, target, interval=0.2):
    window = SourceWindow(VllmSource(target, scrape_interval_s=interval))
    qtbot.addWidget(window)
    return window


def test_the_window_shows_a_vllm_server(qtbot, fake, tmp_path):
    http, events = fake
    window = vllm_window(qtbot, VllmTarget(http.url, events.endpoint, events.replay_endpoint))
    window.resize(1400, 900)
    headers = []  # the fake repeats its last scrape: later intervals show no hits
    window.bridge.updated.connect(lambda u: u.facts and headers.append(window.header.text()))
    window.show()
    window.start()
    try:
        qtbot.waitUntil(lambda: window.last_cache is not None
                        and window.last_cache.stored_total == 6, timeout=30_000)
        qtbot.waitUntil(lambda: len(window.plots.stats) >= 1, timeout=30_000)
        # The plots got vLLM's numbers: queues from the gauges, rates from the counters.
        assert window.plots.steps.values("running")[-1] == 31
        assert window.plots.kv.values("usage")[-1] == pytest.approx(87.4)
        assert "prefix-cache hit rate 50 %" in headers[0]
        assert "5 blocks cached of 27153 in the pool" in window.cache_text.text()
        assert "2 chains" in window.cache_text.text()
        # What vLLM fixes at start-up is shown, and cannot be edited.
        field = window.controls.fields["block_size"]
        assert field.text() == "16" and not field.isEnabled()
        assert "restart" in field.toolTip()
        assert "Not known: physical block ids" in window.known.text()
        # What vLLM does not report says so in place: device memory, per-step batches.
        assert window.device_panel.text() == "device memory: not reported by vllm"
        assert "not reported by vllm" in window.plots.not_reported["batch"]
        assert "vllm at " + http.url in window.status.engine_label.text()
        # Chat through its OpenAI API, in kvscope's own chat panel.
        window.chat.input.setPlainText("why paged?")
        rid = window.chat.send()
        assert rid
        qtbot.waitUntil(lambda: window.chat.turns[rid].done, timeout=30_000)
        assert window.chat.turns[rid].text == "".join(REPLY)
        assert window.chat.conversation().messages[-1] == {"role": "assistant",
                                                           "content": "".join(REPLY)}
        assert http.chats[-1]["messages"] == [{"role": "user", "content": "why paged?"}]
        assert window.grab().save(str(tmp_path / "vllm_window.png"))
    finally:
        window.close()
    assert not window.source._thread.is_alive()


def test_without_kv_events_the_window_says_how_to_get_them(qtbot, fake):
    http, _ = fake
    window = vllm_window(qtbot, VllmTarget(http.url))
    window.start()
    try:
        assert "--kv-events-config" in window.known.text()
        qtbot.waitUntil(lambda: len(window.plots.stats) >= 1, timeout=30_000)
        assert window.last_cache is None
    finally:
        window.close()


def test_a_chat_error_is_shown_and_the_server_marked_dead(qtbot):
    window = vllm_window(qtbot, VllmTarget("http://127.0.0.1:9"), interval=5)
    window.start()
    try:
        window.chat.input.setPlainText("hello?")
        rid = window.chat.send()
        qtbot.waitUntil(lambda: window.chat.turns[rid].done, timeout=30_000)
        assert "GET http://127.0.0.1:9/v1/models" in window.chat.turns[rid].error
        qtbot.waitUntil(lambda: "127.0.0.1:9/metrics" in window.header.text(), timeout=30_000)
        assert window.status.state == "dead" and "DEAD" in window.status.state_label.text()
        assert not window.chat.send_button.isEnabled()
    finally:
        window.close()


def test_kvscope_attach_vllm_from_the_command_line(fake, tmp_path):
    """`kvscope --attach-vllm URL --kv-events ... --screenshot PATH`, as a user runs it."""
    import subprocess
    import sys

    http, events = fake
    shot = tmp_path / "attach.png"
    proc = subprocess.run(
        [sys.executable, "-m", "kvscope", "--attach-vllm", http.url, "--kv-events",
         events.endpoint, "--kv-events-replay", events.replay_endpoint, "--screenshot",
         str(shot), "--after", "4", "--size", "1400x900"],
        check=False, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))
    assert proc.returncode == 0, proc.stderr
    assert shot.stat().st_size > 10_000 and http.scrapes >= 2


def test_malformed_kv_events_are_counted_and_shown(qtbot):
    from tests.app.fake_vllm import SCRIPT

    http, events = FakeVllmHttp(), FakeKvEvents(SCRIPT, interval_s=0.5)
    events.buffer[2] = (2, b"\xc1 not msgpack")  # replayed and published as it is
    window = vllm_window(qtbot, VllmTarget(http.url, events.endpoint, events.replay_endpoint))
    window.start()
    try:
        qtbot.waitUntil(lambda: window.source.counts().bad >= 1, timeout=30_000)
        window.refresh()
        text = window.status.counts_label.text()
        assert ("bad 1" in text or "bad 2" in text) and "KV-event payload" in text
        assert window.status.state == "alive" and window.source._thread.is_alive()
    finally:
        window.close()
        events.stop()
        http.stop()
