"""Nothing on screen says what is not so (issue 53, item 8): a dead engine's map, rates and pool
are greyed and marked "(engine stopped)" until a new engine's first frame; the Engine tab
explains no rotation while no engine is known; a request recomputed after a preemption is
not "decoding"; the reservation line says what it counts; the chat's status line has the
dock's width; the block details grow instead of cutting a line."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import msgspec
import numpy as np

from kvscope.app import stale
from kvscope.app.blocks.block_map import BlockMap
from kvscope.app.chat.panel import ChatPanel
from kvscope.app.chat.turn import DECODING, RECOMPUTING, Turn
from kvscope.app.controls.panel import ControlsPanel
from kvscope.app.plots.batch_plots import BatchPlots
from kvscope.app.status_bar import EngineStatusBar
from kvscope.ipc.messages import Delta
from kvscope.testing.frames import blocks_frame, engine_settings, stats_frame

REASON = "the engine process was killed by SIGKILL"


def _frame(seq=1):
    return blocks_frame(64, 16, {"req-1": [3, 9, 12]}, {12: 5}, seq=seq)


def test_a_dead_engines_block_map_is_dimmed_and_marked_until_a_new_frame(qtbot):
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.resize(900, 500)
    bm.show()
    bm.show_blocks(_frame())
    bm.refresh()
    bm.refresh_labels()
    live = bm.image.image.copy()
    assert "tokens stored in 1 requests" in bm.totals.text()
    assert stale.NOTE not in bm.totals.text()

    bm.mark_stale(REASON)
    assert stale.NOTE in bm.totals.text() and "SIGKILL" in bm.totals.text()
    assert "tokens stored in 1 requests" in bm.totals.text()  # the numbers stay, marked old
    assert stale.NOTE in bm.title.text()
    half = ((live >> 1) & 0x7F7F7F) | 0xFF000000  # every cell at half its brightness
    assert np.array_equal(bm.image.image, half)

    bm.show_blocks(_frame(seq=2))  # a new engine's first frame
    bm.refresh()
    bm.refresh_labels()
    assert stale.NOTE not in bm.totals.text() and stale.NOTE not in bm.title.text()
    assert np.array_equal(bm.image.image, live)


def test_the_reservation_line_says_it_counts_blocks(qtbot):
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.show_blocks(_frame())
    bm.refresh_labels()
    assert "reserving prompt+max_tokens: 8 blocks" in bm.totals.text()


def test_block_details_grow_to_their_text_instead_of_cutting_a_line(qtbot):
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.resize(900, 400)
    bm.show()
    rid = "request " * 30  # an id long enough to need more than the label's 5 lines
    bm.show_blocks(blocks_frame(64, 16, {rid: [1, 2]}, wait_reasons={rid: "no_free_blocks"}))
    bm.select_request(rid)
    bm.refresh_labels()
    label = bm.selection_label
    assert label.heightForWidth(label.width()) <= label.height()
    side = bm.side_area.widget()
    assert side.minimumHeight() >= side.layout().sizeHint().height()


def test_a_dead_engines_rates_are_greyed_until_its_successor_reports(qtbot):
    plots = BatchPlots()
    qtbot.addWidget(plots)
    plots.show_stats(stats_frame())
    plots.refresh()
    assert plots.summary.text().startswith("gen ")
    plots.mark_stale(REASON)
    assert plots.summary.text().startswith(stale.NOTE) and plots.summary.property("stale")
    plots.show_stats(stats_frame(seq=2))
    plots.refresh()
    assert plots.summary.text().startswith("gen ") and not plots.summary.property("stale")
    plots.mark_stale(REASON)
    plots.clear()  # a restart forgets the old numbers altogether
    assert plots.summary.text() == "" and not plots.summary.property("stale")


def test_the_status_bar_marks_a_dead_engines_pool_and_endpoints(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.show_stats(stats_frame())
    assert bar.blocks_label.text().startswith("blocks 60 free / 64 total")
    bar.mark_dead(REASON, exited=True)
    assert bar.blocks_label.text().startswith(f"{stale.NOTE} blocks 60 free")
    assert bar.blocks_label.property("stale")
    assert bar.stream_label.isHidden()  # nothing streams: its room goes to the reason
    bar.mark_connecting("starting the engine…")  # still the dead one's until a new frame
    assert not bar.stream_label.isHidden()
    assert bar.blocks_label.text().startswith(stale.NOTE)
    bar.show_stats(stats_frame(seq=2))
    assert bar.blocks_label.text().startswith("blocks 60 free")
    assert not bar.blocks_label.property("stale")


def test_no_rotation_is_explained_while_no_engine_is_known(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    assert panel.rotation_note.text() == ""  # "—": was "rotated (exact at this precision…)"
    panel.show_config(msgspec.structs.replace(engine_settings(), kv_dtype="float32",
                                              kv_rotation="hadamard"))
    assert "rotated" in panel.rotation_note.text()
    panel.show_unknown()
    assert panel.rotation_note.text() == ""


def test_a_request_recomputed_after_a_preemption_is_not_decoding():
    turn = Turn("req-1", 1)
    turn.on_delta(Delta(request_id="req-1", token_ids=[5] * 40, text="x" * 40,
                        num_output_tokens=40, num_prompt_tokens=8))
    frame = blocks_frame(64, 16, {"req-1": [1, 2, 3]})
    running = msgspec.structs.replace(frame, num_tokens=[48], num_computed_tokens=[47])
    turn.on_blocks(running)
    assert turn.phase == DECODING
    rebuilt = msgspec.structs.replace(frame, num_tokens=[48], num_computed_tokens=[16])
    turn.on_blocks(rebuilt)  # running again on a new pool, its KV computed anew
    assert turn.phase == RECOMPUTING
    text = turn.phase_text()
    assert text.startswith("recomputing after preemption · 16/48 tokens") and \
        "decoding" not in text
    turn.on_delta(Delta(request_id="req-1", token_ids=[], text="", num_output_tokens=40))
    assert turn.phase == RECOMPUTING  # a delta without tokens changes nothing
    turn.on_delta(Delta(request_id="req-1", token_ids=[7], text="y", num_output_tokens=41))
    assert turn.phase == DECODING  # new tokens: it caught up


def test_the_chat_status_line_has_the_docks_width(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.resize(300, 700)  # the dock's least width
    chat.show()
    qtbot.waitExposed(chat)
    text = "● decoding · 931 tokens · 12.3 tok/s"
    chat.phase_label.setText(text)
    assert chat.phase_label.fontMetrics().horizontalAdvance(text) <= \
        chat.phase_label.contentsRect().width()
    phase, toggle = chat.phase_label.geometry(), chat.interactive.geometry()
    assert not phase.intersects(toggle) and phase.width() >= chat.width() - 20


def test_a_dead_engine_is_said_in_the_chat_and_its_meter_greyed(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.set_engine_alive(False, f"the engine is dead: {REASON}")
    # Said, not repeated: the reason is the status bar's (and the Send button's tooltip).
    assert chat.phase_label.text().startswith(stale.NOTE) and "restart" in \
        chat.phase_label.text() and "SIGKILL" not in chat.phase_label.text()
    assert "SIGKILL" in chat.send_button.toolTip()
    assert chat.context_label.text().startswith(stale.NOTE)
    assert "restart" in chat.input.placeholderText()
    chat.set_engine_alive(True)
    assert chat.phase_label.text() == "" and not chat.context_label.property("stale")


def test_a_pool_too_small_for_one_block_names_the_windows_control_once():
    from kvscope.app.engine_process import start_failure
    from kvscope.app.engine_words import in_window_words

    error = ("kvscope serve: error: EngineConfig.kv_cache_bytes=1000 is invalid: one block of "
             "16 tokens needs 368640 bytes")
    message = in_window_words(start_failure("exited with code 2", ["loading the model", error]))
    headline = message.split("\n")[0]
    assert headline.startswith("the engine did not start (exited with code 2): the KV memory "
                               "budget (1000 B) is too small: one block of 16 tokens needs "
                               "360.0 KiB")
    assert "kv_cache_bytes" not in message and message.count("is too small") == 1
    assert message.split("\n")[1:] == ["loading the model"]


def test_a_failed_start_is_said_once_in_the_chat(qtbot, tmp_path):
    """The reason went into the reply's note and again into its stats line ("stop: ..."), and
    whole into the chat's status line and its input: now once in the reply, in full in the
    status bar, and short elsewhere."""
    from PySide6.QtCore import QSettings

    from kvscope.app.main_window import MainWindow

    w = MainWindow(engine_args=[], settings=QSettings(str(tmp_path / "s.ini"),
                                                      QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    try:
        w.chat.set_engine_loading("the engine is starting")
        w.chat.input.setPlainText("hello")
        w.chat.send()  # held until the engine is ready
        w.on_engine_failed("the engine did not start (exited with code 2): kvscope serve: "
                           "error: EngineConfig.kv_cache_bytes=1000 is invalid: one block of 16 "
                           "tokens needs 368640 bytes\nloading the model")
        said = "the KV memory budget (1000 B) is too small"
        assert w.chat.conversation().toPlainText().count(said) == 1
        assert said not in w.chat.phase_label.text() + w.chat.input.placeholderText()
        assert said in w.status.engine_label.text() and "\n" not in w.status.engine_label.text()
        assert "loading the model" in w.status.engine_label.toolTip()
    finally:
        w.shutdown()
