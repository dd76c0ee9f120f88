"""The window against a real engine child (tiny model, CPU): chat, block map, reconfigure,
engine death, clean shutdown."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading

import numpy as np
from PySide6.QtCore import QSettings, Qt

from kvscope.app import colors
from kvscope.app.blocks.block_grid import describe_block, grid_shape
from kvscope.app.main_window import MainWindow
from kvscope.ipc.messages import BLOCK_STATE_MASK, BLOCK_USED
from kvscope.testing.tiny_models import save_tiny_model
from tests.app.leaks import active_timers, leaked_threads

LUT = colors.build_lut()


def check_cells(window, frame):
    """Compare every used cell of the drawn map with the frame: the owner array names the
    request, whose colour (or the shared colour), fill level and dimming the pixel must have.
    Returns (used cells, distinct owners, mismatches)."""
    bm = window.block_map
    bm.refresh()
    img = bm.rendered_image()
    cols = bm.shape[1]
    state = frame.array("flags") & BLOCK_STATE_MASK
    owner = frame.array("owner")
    ref = frame.array("ref_count")
    levels = colors.fill_level(frame.array("filled"), frame.block_size)
    mine = set(frame.block_table(bm.selected)) if bm.selected in frame.request_ids else None
    used = np.flatnonzero(state == BLOCK_USED)
    bad, owners = [], set()
    for b in used:
        o = int(owner[b])
        if not 0 <= o < len(frame.request_ids):
            bad.append((int(b), "owner", o))
            continue
        rid = frame.request_ids[o]
        owners.add(rid)
        slot = colors.SLOT_SHARED if ref[b] > 1 else colors.request_slot(rid)
        idx = slot * colors.FILL_LEVELS + int(levels[b])
        if mine is not None and int(b) not in mine:
            idx += colors.DIM_OFFSET
        want = tuple(int(x) for x in LUT[idx][:3])
        got = img.pixelColor(int(b) % cols, int(b) // cols).getRgb()[:3]
        if got != want:
            bad.append((int(b), rid, got, want))
        if ref[b] == 1 and f"owner {rid}" not in describe_block(frame, int(b)):
            bad.append((int(b), rid, "hover"))
    return len(used), len(owners), bad


def shown_table(window) -> list[int]:
    """The block table widget's physical column, after a label refresh."""
    bm = window.block_map
    bm.refresh_labels()
    return [int(physical) for _, physical, _ in bm.table_model.rows()]


def test_window_with_real_engine(qtbot, tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    before = set(threading.enumerate())  # after transformers' own (tqdm) threads
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    # 512 B/token in float32 -> a 512 KiB budget holds 256 blocks of 4 tokens.
    window = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                     "--block-size", "4", "--kv-cache-bytes", "524288"],
                        settings=settings)
    qtbot.addWidget(window)
    seen = {"in_use": 0, "frames_checked": 0, "cells_checked": 0, "multi_owner": 0, "bad": []}

    def watch(topic, frame):
        if topic != "blocks" or window.block_map.frame is not frame:
            return
        used, owners, bad = check_cells(window, frame)
        if used == 0:
            return
        seen["in_use"] += 1
        seen["frames_checked"] += 1
        seen["cells_checked"] += used
        seen["multi_owner"] += owners >= 2
        seen["bad"] += bad[:5]

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
        assert seen["in_use"] > 0 and not seen["bad"], (seen, turn.num_output)

        # Two chats at once: every used cell is its owner's colour, and selecting a request
        # (from its chat, or by clicking one of its blocks) shows the engine's block table.
        # The random tiny model may stop early at its EOS; these two must overlap, for long
        # enough that a GUI starved of CPU by a busy machine still sees frames of both
        # (2 x ~410 tokens = ~206 of the 256 blocks: no preemption). At 200 tokens each the
        # overlap was a few seconds, and one loaded CI run never saw a frame of it.
        window.chat.max_tokens.setValue(400)
        window.chat.sampling = lambda: {"max_tokens": 400, "temperature": 0.0,
                                        "ignore_eos": True}
        rids = []
        for prompt in ("first parallel chat", "second, a different prompt"):
            window.chat.new_conversation()
            window.chat.input.setPlainText(prompt)
            rids.append(window.chat.send())
        start_step = window.block_map.frame.step

        def both_hold_blocks():
            f = window.block_map.frame
            return f.step >= start_step + 3 and all(
                r in f.request_ids and len(f.block_table(r)) >= 2 for r in rids)

        qtbot.waitUntil(both_hold_blocks, timeout=60_000)
        frame = window.block_map.frame  # no events run between here and the checks
        used, owners, bad = check_cells(window, frame)
        assert used > 0 and owners >= 2 and not bad, (used, owners, bad)
        for i, rid in enumerate(frame.request_ids):  # the frame agrees with itself
            for b in frame.block_table(rid):
                assert frame.array("owner")[b] == i or frame.array("ref_count")[b] > 1

        window.chat.select_request(rids[0])  # what clicking a reply does
        assert window.block_map.selected == rids[0]
        assert shown_table(window) == window.block_map.frame.block_table(rids[0])
        used, owners, bad = check_cells(window, window.block_map.frame)  # others dimmed
        assert not bad, bad

        bm = window.block_map
        target = bm.frame.block_table(rids[1])[-1]
        pos = bm.plot.mapFromScene(bm.block_scene_pos(target))
        qtbot.mouseClick(bm.plot.viewport(), Qt.MouseButton.LeftButton, pos=pos)
        assert bm.selected == rids[1]
        assert shown_table(window) == bm.frame.block_table(rids[1])
        assert str(target) in bm.selection_label.text() or \
            str(target) in [physical for _, physical, _ in bm.table_model.rows()]
        for rid in rids:
            turn2 = window.chat.turns[rid]
            qtbot.waitUntil(lambda t=turn2: t.done, timeout=60_000)
            assert turn2.phase == "finished", turn2.error
        assert not seen["bad"], seen["bad"]
        assert seen["multi_owner"] > 0, seen

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
        assert window.controls.config.block_size == 8
        assert window.controls.config.kv_dtype == "int8"
        qtbot.waitUntil(lambda: window.block_map.frame.block_size == 8, timeout=10_000)
        window.repaint_views()
        new = window.block_map.frame
        assert new.num_blocks != old_blocks
        assert window.block_map.image.image.shape[:2] == grid_shape(
            new.num_blocks, *window.block_map.view_pixels())

        # Killing the engine shows the dead state and offers a restart.
        window.engine.kill()
        qtbot.waitUntil(lambda: window.status.state == "dead", timeout=10_000)
        assert not window.status.restart_button.isHidden()
        qtbot.wait(2500)  # a heartbeat timeout later the real reason is still the one shown
        assert "killed by SIGKILL" in window.status.engine_label.text()
        assert not window.chat.send_button.isEnabled()

        # Restart brings the settings last applied back (issue 23, item 5), and says so.
        window.restart_engine()
        qtbot.waitUntil(lambda: window.controls.config is not None, timeout=120_000)
        assert window.controls.config.block_size == 8
        assert window.controls.config.kv_dtype == "int8"
        assert "restarted engine runs" in window.controls.result.text()
        assert window.chat.send_button.isEnabled()
    finally:
        window.shutdown()
    assert not window.engine.running
    assert active_timers(window) == []
    qtbot.wait(200)
    assert leaked_threads(before) == []
