"""The window over llama.cpp's llama-server (a fake made of its real payloads), headless: the
slot rows of the map, what llama-server does not report said in place, read-only settings,
the chat through its OpenAI API, DEAD and recovery, bad payloads counted and shown, several
engines in tabs, and `kvscope --attach URL` recognising the engine."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import subprocess
import sys

import pytest

from kvscope.app.engines_window import EnginesWindow
from kvscope.app.remote.slot_map import slot_row
from kvscope.app.source_window import SourceWindow
from kvscope.app.sources.llama_server_source import LlamaServerSource
from kvscope.app.sources.source import SlotState
from kvscope.app.sources.vllm_source import VllmSource, VllmTarget
from tests.app.fake_llama_server import REPLY, FakeLlamaServer
from tests.app.fake_vllm import FakeVllmHttp


@pytest.fixture
def fake():
    server = FakeLlamaServer()
    yield server
    server.stop()


def llama_window(qtbot, url, **kw):
    window = SourceWindow(LlamaServerSource(url, poll_interval_s=0.1, **kw))
    qtbot.addWidget(window)
    window.resize(1600, 960)
    return window


def test_a_slot_row_is_filled_to_its_context_and_coloured_by_its_task():
    row = slot_row(SlotState(0, 4096, 1024, 12, True, 5, 100), "llama-server")
    assert row.fraction == 0.25 and "slot 0 · task 12 · processing" in row.text
    assert "1,024 / 4,096 tokens (25 %)" in row.text
    assert row.rgb == slot_row(SlotState(3, 4096, 1, 12, False), "x").rgb  # same task, colour
    assert row.rgb != slot_row(SlotState(0, 4096, 1, 13, True), "x").rgb
    unknown = slot_row(SlotState(1, 4096, None, 7, False), "llama-server")
    assert unknown.fraction is None and "fill not reported by llama-server" in unknown.text


def test_the_window_shows_a_llama_server(qtbot, fake, tmp_path):
    window = llama_window(qtbot, fake.url)
    window.show()
    window.start()
    try:
        qtbot.waitUntil(lambda: bool(window.slot_map.rows) and len(window.plots.stats) >= 1,
                        timeout=30_000)
        rows = window.slot_map.rows
        assert [r.fraction for r in rows] == [1536 / 4096, 700 / 4096, 3900 / 4096, 0.0]
        assert "task 12" in rows[0].text and "never used" in rows[3].text
        assert "no block table and no KV bytes" in window.map_title.text()
        assert "Not reported by llama-server: a block table" in window.known.text()
        # Throughput and queues from /metrics; KV usage and latency say they are missing.
        assert window.plots.steps.values("running")[-1] == 3
        assert window.plots.steps.values("waiting")[-1] == 2
        assert window.plots.stats.values("prompt")[0] > 0  # the fake repeats its 2nd scrape
        assert len(window.plots.kv) == 0
        assert "not reported by llama-server" in window.plots.not_reported["kv"]
        assert "not reported by llama-server" in window.plots.not_reported["latency"]
        window.plots.refresh()
        assert "KV not reported" in window.plots.summary.text()
        assert window.device_panel.text() == "device memory: not reported by llama-server"
        assert "traces: not reported by llama-server" in window.traces.text()
        # Settings fixed at start: read-only, with the reason; unified KV: not reported.
        field = window.controls.fields["n_ctx"]
        assert field.text() == "4096" and not field.isEnabled() and "--ctx-size" in \
            field.toolTip()
        assert "not reported" in window.controls.fields["kv_unified"].text()
        assert "4 slots × 4096 tokens" in window.header.text()
        assert window.status.state == "alive"
        assert window.status.engine_label.text() == f"llama-server at {fake.url}"
        # The chat goes through its OpenAI API, with no priority to promise.
        assert not window.chat.interactive.isEnabled()
        assert "without a priority" in window.chat.interactive.toolTip()
        window.chat.input.setPlainText("what is a slot?")
        rid = window.chat.send()
        qtbot.waitUntil(lambda: window.chat.turns[rid].done, timeout=30_000)
        assert window.chat.turns[rid].text == "".join(REPLY)
        assert fake.chats[-1]["messages"] == [{"role": "user", "content": "what is a slot?"}]
        assert fake.chats[-1]["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert window.grab().save(str(tmp_path / "llama.png"))
    finally:
        window.close()
    assert not window.source._thread.is_alive()


def test_slots_off_says_how_to_turn_them_on(qtbot):
    fake = FakeLlamaServer(slots_enabled=False, metrics_enabled=False)
    window = llama_window(qtbot, fake.url)
    window.start()
    try:
        qtbot.waitUntil(lambda: "--slots" in window.slot_map.message, timeout=30_000)
        assert window.slot_map.rows == []
        qtbot.waitUntil(lambda: "--metrics" in window.notice_label.text(), timeout=30_000)
        assert window.status.state == "alive"
    finally:
        window.close()
        fake.stop()


def test_dead_with_the_reason_then_back(qtbot, fake):
    window = llama_window(qtbot, fake.url, timeout_s=0.5)
    window.start()
    try:
        qtbot.waitUntil(lambda: window.status.state == "alive"
                        and window.plots.last_stats is not None, timeout=30_000)
        fake.stop()
        qtbot.waitUntil(lambda: window.status.state == "dead", timeout=30_000)
        assert f"127.0.0.1:{fake.port}/health" in window.status.state_label.text()
        assert "DEAD" in window.header.text() and not window.chat.send_button.isEnabled()
        assert "unreachable" in window.slot_map.message
        window.plots.refresh()
        assert window.plots.summary.text().startswith("(engine stopped)")  # its last rates
        fake.start()
        qtbot.waitUntil(lambda: window.status.state == "alive", timeout=30_000)
        assert window.chat.send_button.isEnabled()
        qtbot.waitUntil(lambda: not window.plots.stale, timeout=30_000)
        qtbot.waitUntil(lambda: window.slot_map.message == "", timeout=30_000)
    finally:
        window.close()


def test_bad_payloads_are_counted_and_shown_not_a_crash(qtbot, fake):
    fake.bad = "slots"
    window = llama_window(qtbot, fake.url)
    window.start()
    try:
        qtbot.waitUntil(lambda: window.source.counts().bad >= 2, timeout=30_000)
        window.refresh()
        text = window.status.counts_label.text()
        assert "bad " in text and "/slots" in text
        assert window.status.state == "alive"
    finally:
        window.close()


def test_several_engines_one_tab_each(qtbot, fake):
    vllm = FakeVllmHttp()
    pages = [SourceWindow(LlamaServerSource(fake.url, poll_interval_s=0.1)),
             SourceWindow(VllmSource(VllmTarget(vllm.url), scrape_interval_s=0.2))]
    window = EnginesWindow(pages)
    qtbot.addWidget(window)
    window.start()
    try:
        assert window.tabs.count() == 2
        assert window.shown_label.text().startswith(f"showing llama-server at {fake.url}")
        window.tabs.setCurrentIndex(1)
        assert window.shown_label.text().startswith(f"showing vllm at {vllm.url}")
        assert window.windowTitle() == f"kvscope — vllm at {vllm.url}"
        qtbot.waitUntil(lambda: pages[0].status.state == "alive"
                        and pages[1].status.state == "alive", timeout=30_000)
    finally:
        window.close()
        vllm.stop()
    assert all(p.closed for p in pages)


def run_kvscope(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvscope", *args], check=False,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))


def test_attach_recognises_a_llama_server(fake, tmp_path):
    shot = tmp_path / "llama.png"
    proc = run_kvscope("--attach", fake.url, "--screenshot", str(shot), "--after", "3")
    assert proc.returncode == 0, proc.stderr
    assert shot.stat().st_size > 10_000 and fake.hits.get("/slots", 0) >= 1
    assert fake.hits.get("/props", 0) >= 2  # the probe's, then the window's


def test_engine_overrides_the_probe_and_bad_urls_are_refused(fake, tmp_path):
    shot = tmp_path / "forced.png"
    proc = run_kvscope("--attach", fake.url, "--engine", "llama-server", "--screenshot",
                       str(shot), "--after", "2")
    assert proc.returncode == 0, proc.stderr
    assert fake.hits.get("/props", 0) >= 1 and shot.is_file()
    proc = run_kvscope("--attach", "http://127.0.0.1:9", "--screenshot", str(shot))
    assert proc.returncode == 2 and "--engine" in proc.stderr
    proc = run_kvscope("--attach", fake.url, "--engine", "kvscope")
    assert proc.returncode == 2 and "tcp://" in proc.stderr


def test_a_stalled_server_never_stalls_the_window(qtbot, fake):
    import time

    window = llama_window(qtbot, fake.url, timeout_s=0.5)
    window.start()
    try:
        qtbot.waitUntil(lambda: window.status.state == "alive", timeout=30_000)
        fake.delay_s = 5.0  # every reply now takes longer than the source waits
        slowest = 0.0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            t = time.perf_counter()
            window.refresh()  # what the window's timer runs: take + draw
            slowest = max(slowest, time.perf_counter() - t)
            qtbot.wait(20)
        assert slowest < 0.25  # the worker waits on the server, the GUI thread never does
        qtbot.waitUntil(lambda: window.status.state == "dead", timeout=10_000)
        assert "timed out" in window.status.dead_reason
    finally:
        fake.delay_s = 0.0
        window.close()


def test_an_attached_engines_chats_are_saved_and_come_back(qtbot, fake):
    """The attach window's chats are saved as the main window's are, in a folder per engine
    (kind and address): attaching the same engine again brings them back, another one does
    not see them."""
    from kvscope.app.chat.store import attached_folder, default_folder

    window = llama_window(qtbot, fake.url)
    window.start()
    try:
        qtbot.waitUntil(lambda: window.status.state == "alive", timeout=30_000)
        window.chat.input.setPlainText("what is a slot?")
        rid = window.chat.send()
        qtbot.waitUntil(lambda: window.chat.turns[rid].done, timeout=30_000)
    finally:
        window.close()
    folder = attached_folder("llama-server", fake.url)
    assert folder.parent == default_folder() / "attached" and len(list(folder.glob("*.jsonl")))
    again = llama_window(qtbot, fake.url)
    other = llama_window(qtbot, "http://127.0.0.1:9")
    try:
        messages = again.chat.conversation().conversation.messages
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[0].content == "what is a slot?" and messages[1].content == "".join(REPLY)
        assert other.chat.conversation().conversation.messages == []
    finally:
        again.close()
        other.close()
