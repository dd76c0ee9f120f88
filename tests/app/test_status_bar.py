"""Status bar: engine facts from stats; alive/idle from heartbeats; dead when they stop."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from kvscope.app.status_bar import DEAD_AFTER_S, EngineStatusBar
from kvscope.testing.frames import engine_settings, heartbeat, stats_frame


def test_dead_when_heartbeats_stop(qtbot):
    now = [100.0]
    bar = EngineStatusBar(clock=lambda: now[0])
    qtbot.addWidget(bar)
    bar.show_stats(stats_frame())
    assert "cpu" in bar.engine_label.text() and "tiny" in bar.engine_label.text()
    assert "KV float32" in bar.engine_label.text() and "block 16" in bar.engine_label.text()
    assert bar.blocks_label.text() == "blocks 60 free / 64 total"
    bar.show_heartbeat(heartbeat(busy=True))
    assert bar.state == "busy"
    now[0] += DEAD_AFTER_S / 2
    bar.check_heartbeat()
    assert bar.state == "busy" and bar.restart_button.isHidden()
    with qtbot.waitSignal(bar.stateChanged) as sig:
        now[0] += DEAD_AFTER_S
        bar.check_heartbeat()
    assert sig.args == ["dead"]
    assert "DEAD" in bar.state_label.text() and "no heartbeat" in bar.engine_label.text()
    assert not bar.restart_button.isHidden()
    with qtbot.waitSignal(bar.restartRequested):
        bar.restart_button.click()
    bar.show_heartbeat(heartbeat(busy=False))  # back again
    assert bar.state == "idle" and bar.restart_button.isHidden()
    bar.stop_watching()


def test_frames_queued_before_the_process_died_leave_the_reason_in_view(qtbot):
    """kill -9 while a stats frame and a heartbeat are still in flight: they arrive after the
    window learnt of the death and must neither replace "killed by SIGKILL" with the
    engine's settings nor bring it back to life; a restart (connecting) ends that."""
    now = [100.0]
    bar = EngineStatusBar(clock=lambda: now[0])
    qtbot.addWidget(bar)
    bar.show_heartbeat(heartbeat(busy=True))
    bar.mark_dead("killed by SIGKILL", exited=True)
    bar.show_stats(stats_frame())
    bar.show_heartbeat(heartbeat(busy=False))
    assert bar.state == "dead" and "SIGKILL" in bar.engine_label.text()
    assert not bar.restart_button.isHidden()
    bar.mark_connecting()
    bar.show_heartbeat(heartbeat(busy=False))
    bar.show_stats(stats_frame())
    assert bar.state == "idle" and "block 16" in bar.engine_label.text()
    bar.stop_watching()


def test_dead_from_real_timer(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.show_heartbeat(heartbeat())
    bar.last_heartbeat -= DEAD_AFTER_S + 1  # as if it arrived long ago
    qtbot.waitUntil(lambda: bar.state == "dead", timeout=2000)
    bar.stop_watching()


def test_metrics_url_is_shown_only_when_served(qtbot):
    from kvscope.ipc import messages as m

    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.show()
    hello = m.HelloResult(1, "x", "default", 1, engine_settings(), 512, 1 << 20,
                          "http://127.0.0.1:9100/metrics")
    bar.show_hello(hello)
    assert bar.metrics_label.isVisible()
    assert bar.metrics_label.text() == "metrics: http://127.0.0.1:9100/metrics"
    bar.show_hello(m.HelloResult(1, "x", "default", 1, engine_settings(), 512, 1 << 20))
    assert not bar.metrics_label.isVisible() and bar.metrics_label.text() == ""
    bar.stop_watching()


def test_the_kv_rotation_is_shown_with_the_dtype(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.show_stats(stats_frame(kv_dtype="int8", kv_rotation="hadamard",
                               kv_rotation_matrix="Hadamard"))
    assert "KV int8 + Hadamard ·" in bar.engine_label.text()
    bar.show_stats(stats_frame(kv_dtype="int8", kv_rotation="none", kv_rotation_matrix=None))
    assert "KV int8 ·" in bar.engine_label.text()
    bar.show_stats(stats_frame(kv_dtype="fp8", kv_rotation="hadamard",
                               kv_rotation_matrix="random orthogonal"))
    assert "KV fp8 + random orthogonal ·" in bar.engine_label.text()
    bar.show_stats(stats_frame(kv_dtype="int8", kv_rotation="calibrated",
                               kv_rotation_matrix="Hadamard"))
    assert "KV int8 + Hadamard + K balance ·" in bar.engine_label.text()
    bar.show_stats(stats_frame(kv_dtype="int8", kv_rotation="calibrated",
                               kv_rotation_matrix="Hadamard", kv_anchor_tokens=4))
    assert "KV int8 + Hadamard + K balance + 4 exact ·" in bar.engine_label.text()
    bar.stop_watching()
