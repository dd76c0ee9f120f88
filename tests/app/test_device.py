"""The Device panel: memory-bar arithmetic and pixels, header numbers ("—" for what the engine
could not measure), history plots, the shared time window, and the window's `device` topic."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import itertools

import msgspec
import pytest
from PySide6.QtCore import QEvent, QPoint, QSettings
from PySide6.QtGui import QColor, QHelpEvent
from PySide6.QtWidgets import QApplication, QToolTip

from kvscope.app.device.memory_bar import MemoryBar
from kvscope.app.device.memory_math import COLORS, NAMES, bar_edges, memory_segments
from kvscope.app.device.panel import NO_DATA, DevicePanel
from kvscope.app.fmt import human_bytes
from kvscope.app.plots.batch_plots import BatchPlots
from kvscope.ipc.messages import DeviceFrame
from kvscope.testing.frames import stats_frame

GIB = 2**30
MIB = 2**20


def cuda_frame(seq: int = 1, t: float = 1000.0, **over) -> DeviceFrame:
    """An H200-like card: 140 GiB, kvscope holds 100 GiB of the 110 GiB used."""
    base = DeviceFrame(
        seq=seq, time=t, pid=4321, device="cuda:0", name="NVIDIA H200",
        memory_total=140 * GIB, memory_used=110 * GIB, memory_free=30 * GIB,
        process_bytes=100 * GIB, process_source="nvml", weights_bytes=16 * GIB,
        kv_pool_bytes=70 * GIB, kv_used_bytes=30 * GIB, kv_cached_bytes=10 * GIB,
        activations_bytes=6 * GIB, allocator_free_bytes=3 * GIB, other_bytes=5 * GIB,
        gpu_utilization=87.0, memory_utilization=45.0, memory_clock_mhz=2619.0,
        memory_clock_max_mhz=3201.0, temperature_c=54.0, power_w=412.0, power_limit_w=700.0,
        cpu_percent=100.0, num_cpus=16, system_cpu_percent=12.0)
    return msgspec.structs.replace(base, **over)


def cpu_frame(seq: int = 1, t: float = 1000.0, **over) -> DeviceFrame:
    """A CPU engine: no NVML, no torch allocator figures; RAM 64 GiB."""
    base = DeviceFrame(
        seq=seq, time=t, pid=4321, device="cpu", name="AMD EPYC 9654 96-Core Processor",
        memory_total=64 * GIB, memory_used=24 * GIB, memory_free=40 * GIB,
        process_bytes=2 * GIB, process_source="rss", weights_bytes=512 * MIB,
        kv_pool_bytes=1 * GIB, kv_used_bytes=256 * MIB, kv_cached_bytes=128 * MIB,
        other_bytes=512 * MIB, cpu_percent=350.0, num_cpus=8, system_cpu_percent=40.0)
    return msgspec.structs.replace(base, **over)


def xs(curve) -> list[float]:
    return [] if curve.xData is None else list(curve.xData)  # pyqtgraph keeps None when empty


def sizes(frame) -> dict[str, int]:
    return {s.name: s.bytes for s in memory_segments(frame)}


def spans(frame) -> dict[str, float]:
    return {s.name: s.span for s in memory_segments(frame)}


# -- arithmetic ---------------------------------------------------------------------------------
def test_segments_of_a_cuda_frame_add_up_to_the_device():
    f = cuda_frame()
    assert [s.name for s in memory_segments(f)] == list(NAMES)
    assert sizes(f) == {"weights": 16 * GIB, "KV used": 30 * GIB, "KV free": 30 * GIB,
                        "KV cached": 10 * GIB, "other (kvscope)": 14 * GIB,
                        "other processes": 10 * GIB, "free": 30 * GIB}
    assert spans(f) == {k: float(v) for k, v in sizes(f).items()}  # no scaling needed
    assert sum(spans(f).values()) == f.memory_total
    assert all(s.colour == COLORS[s.name] for s in memory_segments(f))
    assert len(set(COLORS.values())) == len(COLORS)  # every segment tells apart


def test_none_fields_count_as_zero_and_negatives_clamp():
    f = cpu_frame()  # activations / allocator_free are None on CPU
    s = sizes(f)
    assert s["other (kvscope)"] == 512 * MIB
    assert s["KV free"] == 1 * GIB - 256 * MIB - 128 * MIB
    assert s["other processes"] == 22 * GIB
    # KV used + cached beyond the pool, a negative remainder, a process bigger than "used":
    g = cuda_frame(kv_pool_bytes=30 * GIB, kv_used_bytes=25 * GIB, kv_cached_bytes=10 * GIB,
                   activations_bytes=None, allocator_free_bytes=None, other_bytes=-2 * GIB,
                   memory_used=90 * GIB)
    s = sizes(g)
    assert (s["KV free"], s["other (kvscope)"], s["other processes"]) == (0, 0, 0)
    assert all(v >= 0 for v in spans(g).values())


def test_parts_beyond_the_total_scale_down_proportionally():
    # RSS-style frame whose parts overflow: 8 + 4 + 0 + 0 + 0 + 6 + 6 = 24 GiB on a 16 GiB box.
    f = cpu_frame(memory_total=16 * GIB, memory_used=10 * GIB, memory_free=6 * GIB,
                  process_bytes=4 * GIB, weights_bytes=8 * GIB, kv_pool_bytes=4 * GIB,
                  kv_used_bytes=4 * GIB, kv_cached_bytes=0, other_bytes=0)
    s, sp = sizes(f), spans(f)
    assert s["weights"] == 8 * GIB and s["free"] == 6 * GIB  # the legend keeps real bytes
    assert sum(sp.values()) == pytest.approx(16 * GIB)
    assert sp["weights"] == pytest.approx(8 * GIB * 16 / 24)
    assert sp["other processes"] == pytest.approx(6 * GIB * 16 / 24)
    assert sp["weights"] / sp["free"] == pytest.approx(8 / 6)


def test_bar_edges_touch_and_follow_bytes():
    f = cuda_frame()
    edges = bar_edges(memory_segments(f), f.memory_total, 280)
    assert edges[0][0] == 0 and edges[-1][1] == 280
    assert all(a[1] == b[0] for a, b in itertools.pairwise(edges))
    widths = [b - a for a, b in edges]
    assert widths == [32, 60, 60, 20, 28, 20, 60]  # 16/140*280 = 32, ...
    assert bar_edges([], 0, 100) == []


# -- the bar widget ---------------------------------------------------------------------------
def test_bar_pixels_and_tooltips(qtbot):
    bar = MemoryBar()
    qtbot.addWidget(bar)
    bar.resize(282, 22)  # 280 px inside the border: 2 px per GiB of 140
    f = cuda_frame()
    bar.set_segments(memory_segments(f), f.memory_total)
    img = bar.grab().toImage()
    y = 11
    # Segment starts (1 px border): weights 1, KV used 33, KV free 93, cached 153,
    # other (kvscope) 173, other processes 201, free 221 .. 280.
    for x, name in ((5, "weights"), (31, "weights"), (34, "KV used"), (92, "KV used"),
                    (100, "KV free"), (160, "KV cached"), (180, "other (kvscope)"),
                    (210, "other processes"), (250, "free"), (279, "free")):
        assert img.pixelColor(x, y) == QColor(COLORS[name]), (x, name)
        assert bar.segment_at(x).name == name
    assert bar.describe(bar.segment_at(100)) == "KV free: 30.0 GiB (21.4 % of 140.0 GiB)"
    bar.show()
    qtbot.waitExposed(bar)
    QApplication.sendEvent(bar, QHelpEvent(QEvent.Type.ToolTip, QPoint(160, 11),
                                           bar.mapToGlobal(QPoint(160, 11))))
    assert QToolTip.text() == "KV cached: 10.0 GiB (7.1 % of 140.0 GiB)"
    QToolTip.hideText()
    # A CPU frame moves the edges: weights are 0.5/64 of the bar, free 40/64.
    c = cpu_frame()
    bar.set_segments(memory_segments(c), c.memory_total)
    img = bar.grab().toImage()
    assert img.pixelColor(2, y) == QColor(COLORS["weights"])
    assert img.pixelColor(6, y) != QColor(COLORS["weights"])
    assert img.pixelColor(280 - 170, y) == QColor(COLORS["free"])
    assert img.pixelColor(280 - 180, y) == QColor(COLORS["other processes"])
    bar.clear()
    assert bar.segment_at(100) is None
    bar.close()


# -- the panel --------------------------------------------------------------------------------
def test_other_processes_are_listed_like_nvidia_smi(qtbot):
    from kvscope.ipc.messages import DeviceProcess

    procs = [DeviceProcess(4321, "python3", 100 * GIB), DeviceProcess(99, "Xorg", 300 * MIB),
             DeviceProcess(7, "", None)]
    panel = DevicePanel()
    qtbot.addWidget(panel)
    panel.show_device(cuda_frame(processes=procs))
    panel.refresh()
    panel.refresh_labels()
    listed = ("pid 4321 kvscope (this engine): 100.0 GiB\npid 99 Xorg: 300.0 MiB\n"
              "pid 7 ?: —")
    other = next(s for s in panel.bar.segments if s.name == "other processes")
    assert panel.bar.describe(other) == \
        f"other processes: 10.0 GiB (7.1 % of 140.0 GiB)\n{listed}"
    assert panel.legend.labels["other processes"].toolTip() == listed
    assert panel.legend.names["other processes"].toolTip() == listed
    panel.show_device(cuda_frame(seq=2, t=1001.0))  # NVML gone: no list, no stale tooltip
    panel.refresh()
    panel.refresh_labels()
    assert panel.bar.describe(other) == "other processes: 10.0 GiB (7.1 % of 140.0 GiB)"
    assert panel.legend.labels["other processes"].toolTip() == ""
    panel.close()


def test_panel_numbers_show_dashes_for_what_was_not_measured(qtbot):
    panel = DevicePanel()
    qtbot.addWidget(panel)
    assert panel.name.text() == NO_DATA and panel.bar.segments == []
    panel.show_device(cuda_frame())
    assert panel.values["gpu"].text() == "—"  # nothing drawn before the label clock
    panel.refresh_labels()
    v = {k: label.text() for k, label in panel.values.items()}
    assert panel.name.text() == "cuda:0 · NVIDIA H200"
    assert v == {"memory": "110.0 / 140.0 GiB used · 30.0 GiB free",
                 "process": "100.0 GiB (nvml)", "temp": "54 °C", "gpu": "87 %",
                 "membw": "45 %", "clock": "2619/3201 MHz", "power": "412/700 W",
                 "cpu": "100 % (6.2 % of 16)", "system": "12 %"}
    panel.refresh()
    assert {n: label.text() for n, label in panel.legend.labels.items()} == {
        "weights": "16.0 GiB", "KV used": "30.0 GiB", "KV free": "30.0 GiB",
        "KV cached": "10.0 GiB", "other (kvscope)": "14.0 GiB", "other processes": "10.0 GiB",
        "free": "30.0 GiB"}

    # A CUDA engine without NVML: the NVML fields are dashes, never zeros.
    panel.show_device(cuda_frame(seq=2, gpu_utilization=None, memory_utilization=None,
                                 memory_clock_mhz=None, memory_clock_max_mhz=None,
                                 temperature_c=None, power_w=None, power_limit_w=None,
                                 cpu_percent=None, system_cpu_percent=None,
                                 process_source="torch"))
    panel.refresh_labels()
    v = {k: label.text() for k, label in panel.values.items()}
    gpu_keys = ("temp", "gpu", "membw", "clock", "power")
    assert all(v[k] == "—" for k in gpu_keys + ("cpu", "system")), v
    assert "(torch)" in v["process"] and "0 %" not in "".join(v.values())
    panel.show_device(cuda_frame(seq=2, memory_clock_mhz=None, power_limit_w=None))
    panel.refresh_labels()  # half of a pair known: the other half is a dash
    assert (panel.values["clock"].text(), panel.values["power"].text()) == ("—/3201 MHz",
                                                                            "412 W")
    assert not any(panel.values[k].isHidden() for k in gpu_keys)

    # A CPU engine: GPU-only rows go away, the CPU rows stay.
    panel.show_device(cpu_frame(seq=3))
    panel.refresh_labels()
    assert panel.name.text() == "cpu · AMD EPYC 9654 96-Core Processor"
    assert all(panel.values[k].isHidden() and panel.keys[k].isHidden() for k in gpu_keys)
    assert panel.values["memory"].text() == "24.0 / 64.0 GiB used · 40.0 GiB free"
    assert panel.values["cpu"].text() == "350 % (43.8 % of 8)"
    assert panel.values["process"].text() == "2.0 GiB (rss)"
    panel.close()


def test_panel_bar_and_history_follow_frames_and_clear(qtbot):
    panel = DevicePanel()
    qtbot.addWidget(panel)
    for i in range(5):
        panel.show_device(cuda_frame(seq=i, t=1000.0 + i, memory_used=(100 + i) * GIB,
                                     memory_free=(40 - i) * GIB))
    assert panel.bar.segments == []  # repaint waits for the clock
    panel.refresh()
    assert sizes(panel.frame) == {s.name: s.bytes for s in panel.bar.segments}
    c = panel.plots.curves
    assert list(c["gpu"].xData) == [0.0, 1.0, 2.0, 3.0, 4.0]  # seconds since the first frame
    assert list(c["gpu"].yData) == [87.0] * 5
    assert list(c["cpu"].yData) == [100.0 / 16] * 5  # engine CPU as a share of the machine
    assert list(c["used"].yData) == [100.0, 101.0, 102.0, 103.0, 104.0]  # GiB
    assert c["process"].yData[0] == 100.0 and c["weights"].yData[0] == 16.0
    assert c["kv_pool"].yData[0] == 70.0
    assert "GPU" in panel.plots.legend_text("util") and "mem bw" in panel.plots.legend_text("util")
    assert panel.plots.plots["memory"].viewRange()[1][0] == 0  # memory axis from 0
    panel.clear()
    panel.refresh()
    assert panel.frame is None and panel.bar.segments == [] and panel.name.text() == NO_DATA
    assert xs(c["gpu"]) == []
    # After a restart the clock starts again at the new first frame; CPU frames leave the
    # GPU curves empty and out of the legend.
    panel.show_device(cpu_frame(t=5000.0))
    panel.show_device(cpu_frame(seq=2, t=5002.0))
    panel.refresh()
    assert xs(c["cpu"]) == [0.0, 2.0] and xs(c["gpu"]) == []
    assert panel.plots.in_legend == {"cpu", "system", "process", "kv_pool", "weights", "used"}
    assert "GPU" not in panel.plots.legend_text("util")
    assert "engine" in panel.plots.legend_text("util")
    panel.close()


def test_window_presets_stay_in_sync_both_ways(qtbot):
    panel, plots = DevicePanel(), BatchPlots()
    qtbot.addWidget(panel)
    qtbot.addWidget(plots)
    plots.windowChanged.connect(panel.set_window)
    panel.windowChanged.connect(plots.set_window)
    seen = []
    panel.windowChanged.connect(seen.append)
    for i in range(400):
        panel.show_device(cuda_frame(seq=i, t=1000.0 + i))
    panel.refresh()
    plots.set_window("Last 5 min")  # from the batch plots' side
    assert panel.plots.window.currentText() == "Last 5 min"
    lo, hi = panel.plots.plots["memory"].viewRange()[0]  # x-linked to the utilization plot
    assert 290 < hi - lo < 320 and hi >= 399
    panel.plots.window.setCurrentText("Last 30 s")  # the user picks it in the device panel
    assert plots.window.currentText() == "Last 30 s"
    lo, hi = panel.plots.plots["util"].viewRange()[0]
    assert hi - lo < 40 and hi >= 399
    plots.window.setCurrentText("All")
    assert panel.plots.window.currentText() == "All"
    assert panel.plots.plots["util"].viewRange()[0][0] <= 1
    assert seen == ["Last 5 min", "Last 30 s", "All"]  # each change once: no echo loop
    panel.close()
    plots.close()


# -- the window --------------------------------------------------------------------------------
def test_window_routes_device_frames_to_the_panel(qtbot, tmp_path, monkeypatch):
    from kvscope.app.main_window import MainWindow

    w = MainWindow(attach="tcp://127.0.0.1:9",
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    to_calculator = []
    monkeypatch.setattr(w.kv_calculator.fits, "set_device", to_calculator.append)
    assert w.device_panel.parent() is w.history_splitter  # beside the batch plots
    assert w.history_splitter.parent() is w.views_splitter  # under the block map
    frame = cuda_frame()
    w.on_state("stats", stats_frame())
    w.on_state("device", frame)
    assert to_calculator == [frame] and w.device_panel.frame is frame
    w.repaint_views()
    w.refresh_labels()
    assert w.device_panel.name.text() == "cuda:0 · NVIDIA H200"
    assert [s.name for s in w.device_panel.bar.segments] == list(NAMES)
    assert xs(w.device_panel.plots.curves["gpu"]) == [0.0]
    w.plots.set_window("Last 5 min")
    assert w.device_panel.plots.window.currentText() == "Last 5 min"
    w.device_panel.plots.window.setCurrentText("Last 30 s")
    assert w.plots.window.currentText() == "Last 30 s"
    w.on_engine_dead("no heartbeat for 3.1 s")
    w.refresh_labels()
    assert w.device_panel.name.text() == \
        "cuda:0 · NVIDIA H200 — last sample, not updating (engine dead)"
    monkeypatch.setattr(w, "start", lambda: None)  # no engine to reach in this test
    w.restart_engine()
    assert w.device_panel.frame is None and w.device_panel.name.text() == NO_DATA
    w.shutdown()


def test_window_fits_a_1600_px_screen_with_live_data(qtbot, tmp_path):
    """The device panel must not push the window wider than a laptop screen, nor may long
    live texts (the plots' summary, the CPU name) once they arrive."""
    from kvscope.app.main_window import MainWindow

    w = MainWindow(attach="tcp://127.0.0.1:9",
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    w.show()
    w.on_state("stats", stats_frame())
    w.on_state("device", cpu_frame(name="AMD EPYC 9654 96-Core Processor with a long name"))
    w.repaint_views()
    w.refresh_labels()
    qtbot.wait(10)
    assert w.plots.summary.text()  # the long summary is there ...
    assert w.minimumSizeHint().width() <= 1600  # ... and does not widen the window
    w.shutdown()



def test_window_shows_a_real_cpu_engine(qtbot, tmp_path):
    """A real engine child on CPU: its device frames reach the panel, and the numbers shown
    are the engine process's own (resident set as psutil reads it, within a few percent)."""
    import threading

    import psutil

    from kvscope.app.main_window import MainWindow
    from kvscope.testing.tiny_models import save_tiny_model
    from tests.app.leaks import leaked_threads

    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    before = set(threading.enumerate())
    w = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                "--kv-cache-bytes", "262144"],
                   settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    try:
        w.start()
        qtbot.waitUntil(lambda: w.device_panel.frame is not None, timeout=120_000)
        first = w.device_panel.frame
        qtbot.waitUntil(lambda: w.device_panel.frame.seq > first.seq, timeout=10_000)
        f = w.device_panel.frame
        rss = psutil.Process(f.pid).memory_info().rss
        assert f.pid == w.engine.pid() and f.device == "cpu" and f.process_source == "rss"
        assert abs(f.process_bytes - rss) <= 0.05 * rss, (f.process_bytes, rss)
        w.repaint_views()
        w.refresh_labels()
        panel = w.device_panel
        assert panel.name.text().startswith("cpu")
        assert panel.values["process"].text() == f"{human_bytes(f.process_bytes)} (rss)"
        assert panel.legend.labels["weights"].text() == human_bytes(f.weights_bytes)
        assert f.kv_pool_bytes >= 262144 * 0.9 and f.weights_bytes > 0
        assert sum(s.span for s in panel.bar.segments) == pytest.approx(f.memory_total,
                                                                       rel=1e-9)
        assert len(panel.plots.util) >= 2 and not panel.values["cpu"].isHidden()
    finally:
        w.shutdown()
    qtbot.wait(200)
    assert leaked_threads(before) == []
