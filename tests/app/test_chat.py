"""Chat: streamed deltas are appended (never a re-render), stats line, phases, failures."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt

from kvscope.app.chat.panel import ChatPanel
from kvscope.ipc.messages import Delta
from kvscope.testing.frames import blocks_frame


def delta(rid, text, n, **kw):
    return Delta(request_id=rid, token_ids=[1] * len(text), text=text, num_output_tokens=n,
                 num_prompt_tokens=12, **kw)


def send(qtbot, chat, text="hi there"):
    qtbot.keyClicks(chat.input, text)
    with qtbot.waitSignal(chat.submitRequested) as sig:
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)
    return sig.args


def test_enter_sends_shift_enter_newline(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    qtbot.keyClicks(chat.input, "line one")
    qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(chat.input, "line two")
    assert chat.input.toPlainText() == "line one\nline two"
    chat.input.clear()
    rid, messages, sampling = send(qtbot, chat)
    assert messages == [{"role": "user", "content": "hi there"}]
    assert sampling["max_tokens"] == chat.max_tokens.value()
    assert chat.input.toPlainText() == ""
    assert not chat.send_button.isEnabled() and chat.stop_button.isEnabled()
    with qtbot.waitSignal(chat.abortRequested) as sig:
        chat.stop()
    assert sig.args == [rid]


def test_deltas_append_without_rerender(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    rid, _, _ = send(qtbot, chat)
    doc = chat.conversation().document()
    changes = []
    doc.contentsChange.connect(lambda pos, removed, added: changes.append((pos, removed, added,
                                                                          doc.characterCount())))
    start = doc.characterCount()
    chat.on_deltas([delta(rid, "Hel", 1), delta(rid, "lo", 2)])  # one batch -> one insert
    chat.on_deltas([delta(rid, ", world", 3)])
    assert len(changes) == 2
    assert all(removed == 0 for _, removed, _, _ in changes)
    assert all(pos >= start - 1 for pos, _, _, _ in changes)  # at the end, never earlier
    assert chat.conversation().toPlainText().endswith("Hello, world")
    chat.on_deltas([delta(rid, "!", 4, finished=True, finish_reason="length", ttft_s=0.05,
                          queued_s=0.01)])
    text = chat.conversation().toPlainText()
    assert "Hello, world!" in text and "TTFT 50 ms" in text and "stop: length" in text
    assert chat.conversation().messages[-1] == {"role": "assistant",
                                                "content": "Hello, world!"}
    assert chat.send_button.isEnabled()


def test_phases_from_engine_state(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    rid, _, _ = send(qtbot, chat)
    turn = chat.turns[rid]
    chat.on_blocks(blocks_frame(64, 16, {rid: [4]}, running=()))
    assert turn.phase == "queued"
    chat.refresh_labels()
    assert "queued" in chat.phase_label.text()
    chat.on_blocks(blocks_frame(64, 16, {rid: [4, 5]}, filled={5: 3}))
    assert turn.phase == "prefill" and turn.max_blocks == 2
    chat.on_deltas([delta(rid, "a", 1)])
    assert turn.phase == "decoding"
    chat.on_blocks(blocks_frame(64, 16, {rid: [4, 5]}, running=()))
    assert turn.phase == "preempted"


def test_engine_death_fails_replies_in_flight(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    rid, _, _ = send(qtbot, chat)
    chat.on_deltas([delta(rid, "partial", 1)])
    chat.fail_all("engine died: no heartbeat")
    turn = chat.turns[rid]
    assert turn.phase == "failed" and not chat.in_flight()
    assert "engine died" in chat.conversation().toPlainText()
    assert chat.send_button.isEnabled()


def test_conversations_and_click_to_select(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    rid1, _, _ = send(qtbot, chat, "first")
    chat.new_conversation()
    assert chat.tabs.count() == 2
    rid2, messages, _ = send(qtbot, chat, "second")
    assert messages == [{"role": "user", "content": "second"}]
    chat.on_deltas([delta(rid1, "one", 1), delta(rid2, "two", 1)])
    assert chat.conversation(0).toPlainText().endswith("one")
    assert chat.conversation(1).toPlainText().endswith("two")
    with qtbot.waitSignal(chat.requestSelected) as sig:
        chat.conversation(0).anchorClicked.emit(f"request:{rid1}")
    assert sig.args == [rid1]
