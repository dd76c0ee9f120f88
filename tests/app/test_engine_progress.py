"""The first start's model conversion shows its progress in the window (issue 53): a fake
engine child prints the conversion's stage lines and a tqdm bar (carriage returns) on stderr;
EngineProcess carries them as Progress, and the status bar and the chat say them."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import sys

from PySide6.QtCore import QSettings

from kvscope.app import engine_process
from kvscope.app.engine_process import EngineProcess
from kvscope.app.engine_progress import Progress, ProgressReader
from kvscope.app.main_window import MainWindow

# What `kvscope serve` prints while it converts the embedded GGUF (engine.loading.
# checkpoint_files' stage lines, transformers' tqdm bar), then its ready line.
FAKE_ENGINE = r"""
import sys, time
err = sys.stderr
err.write("[kvscope] converting: SmolLM2-135M-Instruct.Q4_1.gguf once (first start only: "
          "later starts read /cache/x)\n")
err.write("[kvscope] converting: de-quantizing the weights\n")
err.flush()
for n in (0, 114, 272):
    err.write(f"\rConverting and de-quantizing GGUF tensors...: {100 * n // 272:3d}%|##  "
              f"| {n}/272 [00:03<00:04, 35.1it/s]")
    err.flush()
    time.sleep(0.05)
err.write("\n[kvscope] converting: SmolLM2-135M-Instruct.Q4_1.gguf: done in 3 s\n")
err.flush()
time.sleep(0.5)  # stderr and stdout are two pipes: the ready line comes well after, as it does
print("ready tcp://127.0.0.1:1 tcp://127.0.0.1:2", flush=True)
time.sleep(60)
"""


def test_the_reader_turns_stage_lines_and_bars_into_progress():
    reader = ProgressReader()
    got = reader.feed("Some log line\n[kvscope] converting: m.gguf once (first start only: x)\n")
    assert got == [Progress(None, "converting the model (first start only): m.gguf")]
    got = reader.feed("\rConverting and de-quantizing GGUF tensors...:  42%|####   | 114/272"
                      " [00:03<00:04]\rConverting and de-")  # the second drawing is cut
    assert got == [Progress(0.42, "converting the model (first start only): converting and "
                                  "de-quantizing gguf tensors 42 %")]
    assert reader.feed("quantizing GGUF tensors...: 100%|#####| 272/272 [00:07<00:00]\n")[0] \
        .fraction == 1.0
    assert reader.feed("x" * 5000) == [] and reader.feed("\n") == []  # an endless line: dropped


def test_a_bar_outside_a_conversion_says_nothing():
    assert ProgressReader().feed("Loading:  50%|#####     | 5/10\n") == []


def test_the_engine_process_carries_progress_and_keeps_the_last_drawing(qtbot, monkeypatch):
    monkeypatch.setattr(engine_process, "serve_command",
                        lambda args: [sys.executable, "-c", FAKE_ENGINE])
    proc = EngineProcess([])
    seen = []
    proc.progressed.connect(seen.append)
    try:
        with qtbot.waitSignal(proc.ready, timeout=30_000):
            proc.start()
        qtbot.waitUntil(lambda: any(p.fraction == 1.0 and "converted" in p.text
                                    for p in seen), timeout=10_000)
        fractions = [p.fraction for p in seen if p.fraction is not None]
        assert fractions == [0.0, 0.41, 1.0, 1.0]  # the bar's drawings, then "done"
        assert any("de-quantizing" in p.text for p in seen)
        # The tail an error message would show: the bar as a terminal leaves it, once.
        bars = [line for line in proc.stderr_tail if "GGUF tensors" in line]
        assert len(bars) == 1 and "272/272" in bars[0]
    finally:
        proc.stop(timeout_ms=2000)


def test_the_window_shows_the_conversion_in_the_status_bar_and_the_chat(qtbot, tmp_path):
    w = MainWindow(engine_args=[], settings=QSettings(str(tmp_path / "s.ini"),
                                                      QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    try:
        w.status.mark_connecting("starting the engine (loading the model)…")
        w.chat.set_engine_loading("the engine is starting")
        w.on_engine_progress(Progress(0.42, "converting the model (first start only): "
                                            "de-quantizing 42 %"))
        assert "de-quantizing 42 %" in w.status.engine_label.text()
        assert "de-quantizing 42 %" in w.chat.phase_label.text()
        assert "de-quantizing 42 %" in w.chat.input.placeholderText()
        assert "waits for the engine" in w.chat.input.placeholderText()
    finally:
        w.shutdown()
