"""Priority scheduling in the window (issue 26): the chat's priority toggle, the scheduling
choice, priority / queue time / wait reason per request, preempted blocks flashing on the
map, and preemptions by reason in the status bar."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from types import SimpleNamespace

import msgspec
from PySide6.QtCore import QSettings, Qt

from kvscope.app import settings as app_settings
from kvscope.app.blocks.block_map import BlockMap
from kvscope.app.blocks.flash import FLASH_S, REASON_RGB
from kvscope.app.bridge import Mailbox
from kvscope.app.chat.panel import ChatPanel
from kvscope.app.controls.panel import ControlsPanel
from kvscope.app.main_window import MainWindow, applied_args
from kvscope.app.status_bar import EngineStatusBar
from kvscope.app.traces.panel import engine_args_from
from kvscope.ipc.messages import Sampling
from kvscope.testing.frames import blocks_frame, engine_settings, preemption, stats_frame


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def send(qtbot, chat, text="hi"):
    qtbot.keyClicks(chat.input, text)
    with qtbot.waitSignal(chat.submitRequested) as sig:
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)
    return sig.args


def test_chat_submits_priority_per_toggle(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    assert chat.interactive.isChecked()  # the default: interactive
    tip = chat.interactive.toolTip()
    assert "Lower = sooner" in tip and "priority" in tip and "fcfs" in tip
    rid, _, sampling = send(qtbot, chat)
    assert sampling["priority"] == -1
    assert Sampling(**sampling).priority == -1  # the wire struct takes it as it is
    chat.on_deltas([SimpleNamespace(request_id=rid, token_ids=[1], text="x", finished=True,
                                    finish_reason="stop", num_output_tokens=1,
                                    num_prompt_tokens=3, num_cached_tokens=0,
                                    num_preemptions=0, queued_s=0.0, ttft_s=0.01)])
    assert "priority -1" in chat.conversation().toPlainText()  # the reply's stats line
    chat.interactive.setChecked(False)
    _, _, sampling = send(qtbot, chat, "again")
    assert sampling["priority"] == 0


def test_chat_phase_says_why_it_waits(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    rid, _, _ = send(qtbot, chat)
    chat.on_blocks(blocks_frame(64, 16, {rid: [4]}, running=(), wait_reasons={rid: "memory"}))
    chat.refresh_labels()
    assert "queued" in chat.phase_label.text() and "waiting: KV memory" in \
        chat.phase_label.text()


def waiting_frame(**kw):
    return blocks_frame(64, 16, {"req-a": [1, 2], "req-b": [5]}, running=("req-a",),
                        priorities={"req-a": 0, "req-b": -1},
                        queue_s={"req-a": 0.12, "req-b": None},
                        wait_reasons={"req-b": "memory"}, **kw)


def test_selection_and_hover_show_priority_queue_time_and_wait(qtbot):
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.show_blocks(waiting_frame())
    bm.select_request("req-b")
    text = bm.selection_label.text()
    assert "priority -1" in text and "not scheduled yet" in text
    assert "waiting: KV memory" in text
    assert "no free KV blocks" in bm.selection_label.toolTip()
    bm.select_request("req-a")
    text = bm.selection_label.text()
    assert "priority 0" in text and "queued 120 ms" in text and "waiting" not in text
    hover = bm.describe(2)
    assert "owner req-a" in hover and "priority 0 · queued 120 ms" in hover
    assert "priority -1 · not scheduled yet · waiting: KV memory" in bm.describe(5)
    assert "priority" not in bm.describe(30)  # a free block has no owner to tell of


def test_older_frames_read_as_priority_zero(qtbot):
    bm = BlockMap()
    qtbot.addWidget(bm)
    frame = msgspec.structs.replace(waiting_frame(), request_priorities=[],
                                    request_queue_s=[], request_wait_reasons=[])
    bm.show_blocks(frame)
    bm.select_request("req-b")
    assert "priority 0 · not scheduled yet" in bm.selection_label.text()


def word_rgb(word: int) -> tuple[int, int, int]:
    return (word >> 16) & 0xFF, (word >> 8) & 0xFF, word & 0xFF


def cell(bm: BlockMap, block: int) -> tuple[int, int, int]:
    return word_rgb(int(bm.image.image.reshape(-1)[block]))


def test_preempted_blocks_flash_then_stop(qtbot):
    clock = FakeClock()
    bm = BlockMap(clock=clock)
    qtbot.addWidget(bm)
    bm.show_blocks(blocks_frame(64, 16, {"req-a": [1, 2, 3], "req-b": [9]}))
    bm.refresh()
    free = cell(bm, 20)
    # req-a was preempted for memory: its blocks are free in this frame, and they flash.
    bm.show_blocks(blocks_frame(64, 16, {"req-b": [9]}, seq=2,
                                preemptions=[preemption("req-a", [1, 2, 3], "memory")]))
    bm.refresh()
    assert [cell(bm, b) for b in (1, 2, 3)] == [REASON_RGB["memory"]] * 3
    assert cell(bm, 4) == free and cell(bm, 9) != REASON_RGB["memory"]
    assert "just freed by preempting req-a (memory" in bm.describe(2)
    clock.t += FLASH_S / 2  # fading: between the flash colour and the free colour
    bm.refresh()
    r = cell(bm, 1)[0]
    assert free[0] < r < REASON_RGB["memory"][0]
    clock.t += FLASH_S  # over: the cells are what the frame says, free
    bm.refresh()
    assert [cell(bm, b) for b in (1, 2, 3)] == [free] * 3
    assert not bm.flash.active()
    before = bm.image.image
    bm.refresh()
    assert bm.image.image is before  # nothing flashes: no more redraws
    # A priority preemption flashes in its own colour.
    bm.show_blocks(blocks_frame(64, 16, {"req-c": [1]}, seq=3,
                                preemptions=[preemption("req-b", [9], "priority", 2)]))
    bm.refresh()
    assert cell(bm, 9) == REASON_RGB["priority"] and cell(bm, 1) != REASON_RGB["priority"]


def test_mailbox_keeps_preemptions_of_a_replaced_frame():
    box = Mailbox()
    box.put_frame("blocks", blocks_frame(seq=1, preemptions=[preemption("a", [1], "memory")]))
    box.put_frame("blocks", blocks_frame(seq=2))
    box.put_frame("blocks", blocks_frame(seq=3, preemptions=[preemption("b", [2], "priority")]))
    frames, _ = box.take()
    kept = frames["blocks"]
    assert kept.seq == 3 and [p.request_id for p in kept.preemptions] == ["a", "b"]
    box.put_frame("blocks", blocks_frame(seq=4))
    assert box.take()[0]["blocks"].preemptions == []  # taken ones are not handed on again


def test_status_bar_counts_preemptions_by_reason(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.show()
    bar.show_stats(stats_frame())
    assert not bar.preemptions_label.isVisible()
    bar.show_stats(stats_frame(preemptions_by_reason={"priority": 1, "memory": 3}))
    assert bar.preemptions_label.text() == "preempted: 3 memory · 1 priority"
    assert bar.preemptions_label.isVisible()
    assert "more urgent" in bar.preemptions_label.toolTip()
    bar.show_stats(stats_frame(preemptions_by_reason={"memory": 0, "priority": 2}))
    assert bar.preemptions_label.text() == "preempted: 2 priority"
    bar.show_stats(stats_frame(preemptions_by_reason={"priority": 2}, interrupted_steps=3))
    assert bar.preemptions_label.text() == "preempted: 2 priority · 3 steps interrupted"
    assert "more urgent request" in bar.preemptions_label.toolTip()
    bar.show_stats(stats_frame(interrupted_steps=1))
    assert bar.preemptions_label.text() == "1 step interrupted"
    assert bar.preemptions_label.isVisible()


def test_status_bar_shows_the_decode_path_notice(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.resize(500, 30)
    bar.show()
    bar.show_stats(stats_frame())
    assert not bar.notice_label.isVisible()  # no notice (or an engine without the field)
    notice = "the fused CPU decode does not cover gemma2 yet: the model's own forward runs " \
        "every decode step, which is slower on CPU"
    bar.show_notice(SimpleNamespace(decode_path_notice=notice))
    assert bar.notice_label.isVisible() and bar.notice_label.toolTip() == notice
    qtbot.waitUntil(lambda: bar.notice_label.width() > 0)
    assert bar.notice_label.elided_text().endswith("…")  # one line, cut, whole in the tip
    assert bar.notice_label.height() < 2 * bar.notice_label.fontMetrics().lineSpacing()
    bar.show_notice(SimpleNamespace(decode_path_notice=""))
    assert not bar.notice_label.isVisible()


def test_scheduling_choice_reconfigures_and_is_kept_on_restart(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(engine_settings())
    assert panel.scheduling.currentText() == "fcfs"
    assert "lower = sooner" in panel.scheduling.toolTip()
    panel.scheduling.setCurrentText("priority")
    with qtbot.waitSignal(panel.reconfigureRequested) as sig:
        panel.apply_button.click()
    assert [a.changed() for a in sig.args] == [{"scheduling_policy": "priority"}]
    assert "the KV pool stays" in panel.result.text()
    applied = engine_settings(scheduling_policy="priority")
    panel.show_applied(applied)
    assert "scheduling_policy=priority" in panel.result.text()
    assert panel.changes().changed() == {}
    # A restart starts the child with it (later options win over the base ones).
    args = applied_args(applied)
    i = args.index("--scheduling-policy")
    assert args[i + 1] == "priority"
    args = applied_args(engine_settings(scheduling_policy="fcfs"))  # not the CLI's default
    assert args[args.index("--scheduling-policy") + 1] == "fcfs"
    assert "--scheduling-policy" in engine_args_from(panel.values().changed(), {})  # replays too
    # What the engine says wins: a restarted engine under fcfs shows fcfs.
    panel.show_restarted(engine_settings(scheduling_policy="fcfs"))
    assert panel.scheduling.currentText() == "fcfs"
    panel.show_unknown()
    assert panel.scheduling.currentIndex() == -1 and not panel.scheduling.isEnabled()


def test_interactive_toggle_persists(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    w = MainWindow(attach="tcp://127.0.0.1:9", settings=settings)
    qtbot.addWidget(w)
    try:
        w.chat.interactive.setChecked(False)
    finally:
        w.shutdown()  # saves the settings
    w2 = MainWindow(attach="tcp://127.0.0.1:9", settings=settings)
    qtbot.addWidget(w2)
    try:
        assert not w2.chat.interactive.isChecked()
        w2.chat.interactive.setChecked(True)
        app_settings.save(w2, settings)
        settings.setValue("chat/interactive", "garbage")
        w2.chat.interactive.setChecked(False)
        app_settings.restore(w2, settings)
        assert not w2.chat.interactive.isChecked()  # a corrupt value: left as it was
    finally:
        w2.shutdown()


def test_window_with_a_preemption(qtbot, qapp, tmp_path):
    """The whole window fed a frame with a preemption: map flashes, status bar counts; a
    screenshot goes to $KVSCOPE_PRIORITY_SHOT when set (for a person to look at)."""
    from kvscope.app.main import STYLE

    qapp.setStyleSheet(STYLE.read_text())
    settings = QSettings(str(tmp_path / "w.ini"), QSettings.Format.IniFormat)
    w = MainWindow(attach="tcp://127.0.0.1:9", settings=settings)
    qtbot.addWidget(w)
    try:
        w.resize(1600, 900)
        w.show()
        qtbot.waitExposed(w)
        w.block_map.flash.clock = FakeClock()  # held at the flash's start for the picture
        tables = {f"req-{i}": list(range(8 * i, 8 * i + 6)) for i in range(1, 5)}
        w.on_state("blocks", blocks_frame(96, 16, tables))
        w.repaint_views()
        del tables["req-2"]
        tables["chat-1"] = [70, 71]
        w.on_state("blocks", blocks_frame(
            96, 16, tables, seq=2, running=("req-1", "req-3", "req-4"),
            priorities={"chat-1": -1}, wait_reasons={"chat-1": "memory"},
            preemptions=[preemption("req-2", range(16, 22), "priority")]))
        w.on_state("stats", stats_frame(preemptions_by_reason={"memory": 3, "priority": 1}))
        w.block_map.select_request("chat-1")
        w.repaint_views()
        w.refresh_labels()
        qapp.processEvents()
        assert w.status.preemptions_label.text() == "preempted: 3 memory · 1 priority"
        assert w.status.preemptions_label.isVisible()
        assert cell(w.block_map, 16) == REASON_RGB["priority"]
        assert "priority -1" in w.block_map.selection_label.text()
        shot = os.environ.get("KVSCOPE_PRIORITY_SHOT")
        if shot:
            assert w.grab().save(shot)
    finally:
        w.shutdown()
        qapp.setStyleSheet("")


def test_window_with_real_engine_priority_and_preemptions(qtbot, tmp_path):
    """A real engine child (tiny model, CPU) with a pool too small for its load: the chat's
    priority reaches the engine, the scheduling choice is applied at run time, and the
    engine's preemptions reach the map (flash) and the status bar (counts by reason)."""
    from kvscope.testing.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    # 64 blocks of 4 tokens: two background requests growing to ~150 tokens need ~78.
    window = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                     "--block-size", "4", "--num-kv-blocks", "64",
                                     "--max-model-len", "256"], settings=settings)
    qtbot.addWidget(window)
    flashed, priorities = [], {}

    def watch(topic, frame):
        if topic == "blocks":
            flashed.extend(frame.preemptions)
            priorities.update(zip(frame.request_ids, frame.request_priorities, strict=True))

    window.bridge.stateReceived.connect(watch)
    try:
        window.show()
        window.start()
        qtbot.waitUntil(lambda: window.hello is not None, timeout=120_000)
        engine_default = window.hello.config.scheduling_policy
        assert window.controls.scheduling.currentText() == engine_default
        other = "fcfs" if engine_default == "priority" else "priority"
        for policy in (other, "priority"):
            if window.controls.scheduling.currentText() == policy:
                continue
            window.controls.scheduling.setCurrentText(policy)
            with qtbot.waitSignal(window.bridge.reconfigured, timeout=60_000) as sig:
                window.controls.apply()
            assert sig.args[0].scheduling_policy == policy
            assert window.applied.scheduling_policy == policy
            assert window.controls.scheduling.currentText() == policy
        failed = []
        window.bridge.submitFailed.connect(lambda r, msg: failed.append((r, msg)))
        background = {"max_tokens": 150, "temperature": 0.0, "ignore_eos": True, "priority": 0}
        for i in range(2):
            window.bridge.submit(f"bg-{i}", f"bg {i}", background)
        # The tiny model's replies end early at its EOS: this one stays long enough to be
        # seen in the engine's frames (the priority part is the panel's own).
        own_sampling = window.chat.sampling
        window.chat.sampling = lambda: {**own_sampling(), "max_tokens": 150, "ignore_eos": True}
        window.chat.input.setPlainText("the chat goes first")
        rid = window.chat.send()
        assert window.chat.turns[rid].priority == -1
        qtbot.waitUntil(lambda: window.chat.turns[rid].done, timeout=120_000)
        assert not failed, failed
        qtbot.waitUntil(lambda: bool(flashed), timeout=60_000)
        # Stats frames trail the block frames, and an interrupted step can show first.
        qtbot.waitUntil(lambda: window.status.preemptions_label.text().startswith("preempted: "),
                        timeout=30_000)
        assert priorities.get(rid) == -1 and priorities.get("bg-0") == 0
        assert all(p.reason in ("memory", "priority") and p.block_ids for p in flashed)
        # The priority policy preempts the least urgent: never the interactive chat.
        assert rid not in {p.request_id for p in flashed}
        assert window.chat.turns[rid].num_preemptions == 0
        assert "--scheduling-policy" in applied_args(window.applied)
    finally:
        window.shutdown()
