"""The window against a real engine child (tiny model, CPU): chat, block map, reconfigure,
engine death, clean shutdown."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading

from app_fakes import active_timers, leaked_threads
from PySide6.QtCore import QSettings, Qt
from tiny_models import save_tiny_model

from app import colors
from app.block_grid import grid_shape
from app.main_window import MainWindow
from ipc.messages import BLOCK_STATE_MASK, BLOCK_USED


def test_window_with_real_engine(qtbot, tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    before = set(threading.enumerate())  # after transformers' own (tqdm) threads
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    # 512 B/token in float32 -> a 256 KiB budget holds 128 blocks of 4 tokens.
    window = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                     "--block-size", "4", "--kv-cache-bytes", "262144"],
                        settings=settings)
    qtbot.addWidget(window)
    seen = {"in_use": 0, "pixel_ok": 0}

    def watch(topic, frame):
        turn = next(iter(window.chat.turns.values()), None)
        if topic != "blocks" or turn is None or turn.request_id not in frame.request_ids:
            return
        table = frame.block_table(turn.request_id)
        if not table:
            return
        seen["in_use"] += 1
        window.block_map.refresh()  # what the next 30 Hz tick would draw
        b = table[0]
        cols = window.block_map.shape[1]
        pixel = window.block_map.rendered_image().pixelColor(b % cols, b // cols)
        state = frame.array("flags")[b] & BLOCK_STATE_MASK
        level = colors.fill_level(frame.array("filled")[b:b + 1], frame.block_size)[0]
        want = colors.build_lut()[colors.request_slot(turn.request_id) * colors.FILL_LEVELS
                                  + level][:3]
        if state == BLOCK_USED and frame.array("ref_count")[b] == 1 and \
                pixel.getRgb()[:3] == tuple(int(x) for x in want):
            seen["pixel_ok"] += 1

    window.bridge.stateReceived.connect(watch)
    try:
        window.show()
        window.start()
        qtbot.waitUntil(lambda: window.hello is not None, timeout=120_000)
        assert window.controls.block_size.currentText() == "4"

        window.chat.max_tokens.setValue(300)
        window.chat.temperature.setValue(0.0)
        qtbot.keyClicks(window.chat.input, "hello engine")
        qtbot.keyClick(window.chat.input, Qt.Key.Key_Return)
        turn = next(iter(window.chat.turns.values()))
        qtbot.waitUntil(lambda: turn.done, timeout=60_000)
        assert turn.phase == "finished", turn.error
        assert turn.num_output > 0 and turn.text
        assert turn.text in window.chat.conversation().toPlainText()
        assert "TTFT" in window.chat.conversation().toPlainText()  # the stats line
        assert seen["in_use"] > 0 and seen["pixel_ok"] > 0, (seen, turn.num_output)

        # After the reply: nothing is in use, the blocks are free or cached.
        qtbot.waitUntil(lambda: window.block_map.frame is not None
                        and window.block_map.frame.used == 0, timeout=10_000)
        frame = window.block_map.frame
        assert frame.free + frame.cached == frame.num_blocks

        # Block size and KV dtype from the controls reach the engine; the map redraws.
        old_blocks = frame.num_blocks
        window.controls.block_size.setCurrentText("8")
        window.controls.kv_dtype.setCurrentText("int8")
        window.controls.apply_button.click()
        qtbot.waitUntil(lambda: not window.controls.busy, timeout=60_000)
        assert window.controls.result.property("state") == "ok", window.controls.result.text()
        assert window.controls.config["block_size"] == 8
        assert window.controls.config["kv_dtype"] == "int8"
        qtbot.waitUntil(lambda: window.block_map.frame.block_size == 8, timeout=10_000)
        window.repaint_views()
        new = window.block_map.frame
        assert new.num_blocks != old_blocks
        assert window.block_map.image.image.shape == grid_shape(new.num_blocks)

        # Killing the engine shows the dead state and offers a restart.
        window.engine.kill()
        qtbot.waitUntil(lambda: window.status.state == "dead", timeout=10_000)
        assert not window.status.restart_button.isHidden()
    finally:
        window.shutdown()
    assert not window.engine.running
    assert active_timers(window) == []
    qtbot.wait(200)
    assert leaked_threads(before) == []
