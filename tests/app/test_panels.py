"""KV calculator, load generator, batch plots, settings persistence, entry-point options."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json
import sys

import numpy as np
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QWidget

from kvscope.app.calculator import kv_math
from kvscope.app.calculator.panel import KVCalculatorPanel
from kvscope.app.controls.load_generator import LoadGenerator
from kvscope.app.main import build_parser, engine_args
from kvscope.app.plots.batch_plots import BatchPlots
from kvscope.ipc.messages import Delta
from kvscope.testing.frames import blocks_frame, stats_frame, step_frame


def test_kv_math_matches_known_models():
    qwen = kv_math.ModelShape(*kv_math.PRESETS["Qwen2-7B"])
    assert kv_math.bytes_per_token(qwen, "bfloat16") == 56 * 1024
    assert kv_math.bytes_per_token(qwen, "bfloat16") * 1_000_000 / 2**30 == \
        __import__("pytest").approx(53.4, abs=0.05)
    # int8: one byte per element plus a float32 scale per token, head, layer, K/V.
    assert kv_math.bytes_per_token(qwen, "int8") == 2 * 28 * 4 * (128 + 4)
    shape = kv_math.shape_from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "hidden_size": 64})
    assert shape == kv_math.ModelShape(2, 2, 16)


def test_kv_math_uses_fragsim_without_torch():
    import subprocess
    import sys

    code = ("import sys, kvscope.app.calculator.kv_math; "
            "print('torch' in sys.modules, 'PySide6' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_fragsim_defaults_through_the_app_code():
    from kvscope.kvmath.fragsim import random_lengths

    c = kv_math.compare(random_lengths(1000, 50, 2048, seed=42), max_len=2048, block_size=16)
    assert (round(100 * c.reserved_waste, 1), round(100 * c.paged_waste, 1)) == (48.7, 0.7)


def test_reserved_vs_paged_waste():
    c = kv_math.compare([10, 100, 1], max_len=128, block_size=16)
    assert c.used_slots == 111 and c.reserved_slots == 384 and c.paged_slots == 16 + 112 + 16
    assert c.reserved_waste > 0.7
    assert c.paged_waste < 0.3
    a = kv_math.sample_lengths("lognormal", 700, 4096, 50, seed=3)
    assert a == kv_math.sample_lengths("lognormal", 700, 4096, 50, seed=3)
    assert all(1 <= x <= 4096 for x in a)


def test_kv_calculator_panel(qtbot, tmp_path):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.source.setCurrentText("Qwen2-7B")
    panel._source_chosen()
    panel.dtype.setCurrentText("bfloat16")
    panel.context.setValue(1_000_000)
    assert "56.0 KiB" in panel.per_token.text() and "53.4 GiB" in panel.per_token.text()
    assert "wasted" in panel.comparison.text()
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 64}))
    panel.source.setCurrentText("Running engine")
    panel.set_running_model(str(cfg))
    assert (panel.layers.value(), panel.kv_heads.value(), panel.head_dim.value()) == (2, 2, 16)


def test_load_generator_is_seeded_and_capped(qtbot):
    def run(seed):
        gen = LoadGenerator()
        gen.seed, gen.rate, gen.concurrency = seed, 200.0, 3
        sent = []
        gen.submitRequested.connect(lambda rid, prompt, sampling: sent.append(
            (rid, prompt, sampling["max_tokens"])))
        gen.start()
        qtbot.waitUntil(lambda: len(sent) == 3 and len(gen.backlog) > 0, timeout=5000)
        assert len(gen.in_flight) == 3  # never more than the cap
        finished = Delta(request_id=sent[0][0], token_ids=[], text="", finished=True)
        gen.on_deltas([finished])
        qtbot.waitUntil(lambda: len(sent) == 4, timeout=5000)
        aborted = []
        gen.abortRequested.connect(aborted.append)
        gen.stop()
        assert sorted(aborted) == sorted(gen.in_flight) and not gen.running
        return [s[1:] for s in sent]

    assert run(7) == run(7)


def test_batch_plots_take_history_once_and_window_presets(qtbot):
    plots = BatchPlots()
    qtbot.addWidget(plots)
    t = 1000.0
    for i in range(1, 50):
        plots.show_step(step_frame(i, t + i, prefill=8, decode=2))
        plots.show_step(step_frame(i, t + i))  # the same step again: not counted twice
    plots.show_blocks(blocks_frame(64, 16, {"a": [1, 2]}))
    plots.show_stats(stats_frame(t=t + 49))
    plots.refresh()
    assert len(plots.steps) == 49
    x, y = plots.curves["prefill"].xData, plots.curves["prefill"].yData
    assert len(x) == 49 and y[0] == 8
    assert "gen 50 tok/s" in plots.summary.text()
    plots.set_window("Last 30 s")
    lo, hi = plots.plots["batch"].viewRange()[0]
    assert hi - lo < 40
    plots.set_window("All")
    lo, hi = plots.plots["batch"].viewRange()[0]
    assert lo <= 1


def test_engine_options_pass_through():
    args = build_parser().parse_args(["--model", "/m", "--block-size", "8", "--kv-dtype",
                                      "int8", "--no-prefix-caching", "--demo"])
    assert engine_args(args) == ["--model", "/m", "--block-size", "8", "--kv-dtype", "int8",
                                 "--no-prefix-caching"]
    assert build_parser().parse_args(["--attach", "tcp://h:5570"]).attach == "tcp://h:5570"
    args = build_parser().parse_args(["--metrics-port", "9100"])
    assert engine_args(args) == ["--metrics-port", "9100"]
    args = build_parser().parse_args(["--scheduling-policy", "fcfs", "--priority-aging-s", "5",
                                      "--max-prefill-tokens-while-decoding", "64"])
    assert engine_args(args) == ["--scheduling-policy", "fcfs", "--priority-aging-s", "5.0",
                                 "--max-prefill-tokens-while-decoding", "64"]


def test_settings_persist_between_runs(qtbot, tmp_path):
    from kvscope.app.main_window import MainWindow

    path = str(tmp_path / "s.ini")
    w = MainWindow(attach="tcp://127.0.0.1:9", settings=QSettings(path, QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    w.chat.max_tokens.setValue(77)
    w.load_panel.rate.setValue(5.5)
    w.plots.set_window("Last 5 min")
    w.kv_calculator.context.setValue(8192)
    w.side_tabs.setCurrentIndex(2)
    kv = w.kv_calculator
    kv.fits.manual_gib.setValue(40.0)  # typing an amount switches to manual ...
    assert kv.fits.source.currentText() != "this device"
    kv.fits.source.setCurrentText("this device")  # ... and the user switched back
    kv.fits.headroom.setValue(7.5)
    w.shutdown()
    assert QSettings(path, QSettings.Format.IniFormat).value("window/views_splitter") is not None
    w2 = MainWindow(attach="tcp://127.0.0.1:9",
                    settings=QSettings(path, QSettings.Format.IniFormat))
    qtbot.addWidget(w2)
    assert w2.chat.max_tokens.value() == 77 and w2.load_panel.rate.value() == 5.5
    assert w2.plots.window.currentText() == "Last 5 min"
    assert w2.kv_calculator.context.value() == 8192 and w2.side_tabs.currentIndex() == 2
    kv2 = w2.kv_calculator
    assert (kv2.fits.manual_gib.value(), kv2.fits.headroom.value()) == (40.0, 7.5)
    assert kv2.fits.source.currentText() == "this device"
    w2.shutdown()


def test_void_qt_calls_keep_none_refcount():
    """PySide6 6.12.0 dropped a reference to None per void call (none_dealloc abort)."""
    w = QWidget()
    before = sys.getrefcount(None)
    for _ in range(20_000):
        w.setEnabled(True)
    assert sys.getrefcount(None) >= before - 100


def test_kv_calculator_hints_come_from_the_measured_table(qtbot):
    from kvscope.app.calculator import accuracy

    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    for dtype in ("int8", "fp8", "bfloat16"):
        panel.dtype.setCurrentText(dtype)
        plain = accuracy.MEASURED[(dtype, "none")]
        assert f"{plain.prefix:.0%}" in panel.accuracy.text(), dtype
        rotated = accuracy.MEASURED.get((dtype, accuracy.DEFAULT_SETTING.get(dtype, "none")))
        rotated = None if rotated is plain else rotated
        assert (rotated is not None) == (dtype in ("int8", "fp8"))  # the 1-byte defaults
        if rotated:
            assert f"{rotated.prefix:.0%} of a greedy reply" in panel.accuracy.text()
            assert f"KL {rotated.kl:.2g}" in panel.accuracy.text()
            assert "the default" in panel.accuracy.text()
    panel.dtype.setCurrentText("float32")
    assert "reference" in panel.accuracy.text()


@pytest.mark.parametrize("which", ["load", "trace", "calculator"])
def test_controls_panels_fit_the_narrowest_dock_without_sideways_scrolling(qtbot, which):
    from kvscope.app.bridge import EngineBridge
    from kvscope.app.calculator.panel import KVCalculatorPanel
    from kvscope.app.controls.load_generator import LoadGenerator, LoadGeneratorPanel
    from kvscope.app.main_window import SIDE_MIN_WIDTH, scrollable
    from kvscope.app.traces.panel import TracePanel

    bridge = EngineBridge()
    panel = {"load": lambda: LoadGeneratorPanel(LoadGenerator()),
             "trace": lambda: TracePanel(bridge),
             "calculator": KVCalculatorPanel}[which]()
    area = scrollable(panel)
    qtbot.addWidget(area)
    try:
        area.resize(SIDE_MIN_WIDTH - 14, 900)  # the dock's narrowest content, less its frame
        area.show()
        qtbot.waitExposed(area)
        assert panel.minimumSizeHint().width() <= area.viewport().width()
        assert not area.horizontalScrollBar().isVisible()
        qtbot.waitUntil(lambda: panel.width() <= area.viewport().width(), timeout=2000)
    finally:
        if which == "trace":
            panel.stop()
        area.close()
        bridge.close()


def test_requests_plot_breaks_across_idle_gaps_instead_of_ramping(qtbot):
    import numpy as np

    plots = BatchPlots()
    qtbot.addWidget(plots)
    t = 1000.0
    busy = [t + 0.05 * i for i in range(10)] + [t + 30 + 0.05 * i for i in range(10)]
    for i, when in enumerate(busy, 1):  # two bursts of steps, 30 s of idle between
        plots.show_step(step_frame(i, when, prefill=8, decode=2))
    plots.refresh()
    x, y = plots.curves["running"].getData()
    assert np.isnan(y).sum() == 1  # one break, in the idle gap
    gap = int(np.flatnonzero(np.isnan(y))[0])
    assert x[gap - 1] < x[gap] < x[gap + 1] and x[gap + 1] - x[gap - 1] > 29
    assert plots.curves["running"].opts["connect"] == "finite"
    # busy stretches stay whole
    plots.steps.clear()
    for i, when in enumerate(busy[:10], 100):
        plots.show_step(step_frame(i, when))
    plots.refresh()
    assert not np.isnan(plots.curves["running"].getData()[1]).any()


@pytest.mark.parametrize("which", ["batch", "device", "trace"])
def test_small_plots_label_only_the_ticks_that_fit(qtbot, which):
    from PySide6.QtGui import QFontMetrics

    from kvscope.app.device.plots import DevicePlots
    from kvscope.app.traces.plot import TraceOverlayPlot

    widget = {"batch": BatchPlots, "device": DevicePlots, "trace": TraceOverlayPlot}[which]()
    qtbot.addWidget(widget)
    widget.resize(600, 400)
    widget.show()
    qtbot.waitExposed(widget)
    plot_items = (list(widget.plots.values()) if hasattr(widget, "plots")
                  else [widget.tokens_plot, widget.kv_plot])
    for plot in plot_items:
        plot.setYRange(0, 12345, padding=0)
        axis = plot.getAxis("left")
        size = axis.height()
        assert size > 0
        levels = axis.tickValues(0, 12345, size)
        values = [v for _, vs in levels for v in vs if 0 <= v <= 12345]
        label_px = QFontMetrics(axis.style["tickFont"]).height()
        assert len(values) >= 2
        gaps = np.diff(sorted(values)) * size / 12345
        assert gaps.min() >= label_px, (which, size, values)  # no label over another


def test_batch_header_keeps_its_title_and_wraps_the_summary_when_narrow(qtbot):
    from PySide6.QtWidgets import QLabel

    plots = BatchPlots()
    qtbot.addWidget(plots)
    plots.show_stats(stats_frame(t=1.0))
    plots.refresh()
    plots.resize(420, 300)
    plots.show()
    qtbot.waitExposed(plots)
    title = next(lb for lb in plots.findChildren(QLabel) if lb.text() == "Batch & memory")
    assert title.width() >= title.sizeHint().width()
    summary = plots.summary
    assert summary.fontMetrics().horizontalAdvance(summary.text()) > summary.width()  # long
    need = summary.heightForWidth(summary.width())
    assert need > summary.fontMetrics().height()  # it takes a second line: it wraps
    qtbot.waitUntil(lambda: summary.height() >= need)
    assert summary.geometry().right() <= plots.width()  # wrapped inside, not clipped
