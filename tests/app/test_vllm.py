"""`kvscope --attach-vllm`: the window over a fake vLLM made of vLLM's real formats (recorded
/metrics text, hand-built KV-event msgpack with replay, an OpenAI streaming chat)."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from kvscope.app.vllm.source import VllmTarget
from kvscope.app.vllm.window import VllmWindow
from tests.app.fake_vllm import REPLY, FakeKvEvents, FakeVllmHttp


@pytest.fixture
def fake():
    http, events = FakeVllmHttp(), FakeKvEvents()
    yield http, events
    events.stop()
    http.stop()


def test_the_window_shows_a_vllm_server(qtbot, fake, tmp_path):
    http, events = fake
    window = VllmWindow(VllmTarget(http.url, events.endpoint, events.replay_endpoint),
                        scrape_interval_s=0.2)
    qtbot.addWidget(window)
    window.resize(1400, 900)
    window.show()
    window.start()
    try:
        qtbot.waitUntil(lambda: window.last_cache is not None
                        and window.last_cache.stored_total == 6, timeout=30_000)
        qtbot.waitUntil(lambda: len(window.plots.stats) >= 1, timeout=30_000)
        # The plots got vLLM's numbers: queues from the gauges, rates from the counters.
        assert window.plots.steps.values("running")[-1] == 31
        assert window.plots.kv.values("usage")[-1] == pytest.approx(87.4)
        assert "prefix-cache hit rate 50 %" in window.header.text()
        assert "5 blocks cached of 27153 in the pool" in window.cache_text.text()
        assert "2 chains" in window.cache_text.text()
        # What vLLM fixes at start-up is shown, and cannot be edited.
        field = window.controls.fields["block_size"]
        assert field.text() == "16" and not field.isEnabled()
        assert "restart" in field.toolTip()
        assert "Not known: physical block ids" in window.known.text()
        # Chat through its OpenAI API.
        window.chat.input.setPlainText("why paged?")
        assert window.chat.send()
        qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=30_000)
        assert "".join(REPLY) in window.chat.transcript.toPlainText()
        assert window.chat.messages[-1] == {"role": "assistant", "content": "".join(REPLY)}
        assert http.chats[-1]["messages"] == [{"role": "user", "content": "why paged?"}]
        assert window.grab().save(str(tmp_path / "vllm_window.png"))
    finally:
        window.close()
    assert not window.source._thread.is_alive()


def test_without_kv_events_the_window_says_how_to_get_them(qtbot, fake):
    http, _ = fake
    window = VllmWindow(VllmTarget(http.url), scrape_interval_s=0.2)
    qtbot.addWidget(window)
    window.start()
    try:
        assert "--kv-events-config" in window.known.text()
        qtbot.waitUntil(lambda: len(window.plots.stats) >= 1, timeout=30_000)
        assert window.last_cache is None
    finally:
        window.close()


def test_a_chat_error_is_shown_and_the_turn_dropped(qtbot):
    window = VllmWindow(VllmTarget("http://127.0.0.1:9"), scrape_interval_s=5)
    qtbot.addWidget(window)
    window.start()
    try:
        window.chat.input.setPlainText("hello?")
        window.chat.send()
        qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=30_000)
        assert "[error: GET http://127.0.0.1:9/v1/models" in window.chat.transcript.toPlainText()
        assert window.chat.messages == []
        qtbot.waitUntil(lambda: "127.0.0.1:9/metrics" in window.header.text(), timeout=30_000)
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
