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


def test_deltas_touch_only_the_reply_in_flight(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.render_interval_s = 0  # every batch renders (the rate limit has its own test)
    rid, _, _ = send(qtbot, chat)
    doc = chat.conversation().document()
    changes = []
    doc.contentsChange.connect(lambda pos, removed, added: changes.append(pos))
    start = doc.characterCount() - 1  # the end of the transcript before the reply's text
    chat.on_deltas([delta(rid, "Hel", 1), delta(rid, "lo", 2)])  # one batch -> one render
    chat.on_deltas([delta(rid, ", world", 3)])
    assert changes and min(changes) >= start  # nothing above the reply was touched
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
    assert chat.stack.count() == 2 and chat.sidebar.count() == 2
    rid2, messages, _ = send(qtbot, chat, "second")
    assert messages == [{"role": "user", "content": "second"}]
    chat.on_deltas([delta(rid1, "one", 1), delta(rid2, "two", 1)])
    assert chat.conversation(0).toPlainText().endswith("one")
    assert chat.conversation(1).toPlainText().endswith("two")
    with qtbot.waitSignal(chat.requestSelected) as sig:
        chat.conversation(0).anchorClicked.emit(f"request:{rid1}")
    assert sig.args == [rid1]


def test_send_disabled_while_engine_dead(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.set_engine_alive(False, "engine died: no heartbeat")
    assert not chat.send_button.isEnabled()
    assert "no heartbeat" in chat.send_button.toolTip()
    qtbot.keyClicks(chat.input, "hello?")
    with qtbot.assertNotEmitted(chat.submitRequested):
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)  # Enter does not send either
        chat.send()
    assert chat.input.toPlainText() == "hello?"  # the message is kept for later
    assert "hello?" not in chat.conversation().toPlainText()
    chat.set_engine_alive(True, "")
    assert chat.send_button.isEnabled() and chat.send_button.toolTip() == ""
    rid, messages, _ = send(qtbot, chat, "")
    assert messages == [{"role": "user", "content": "hello?"}] and rid in chat.turns
    chat.set_engine_alive(True, "")  # alive again while a reply is in flight: still busy
    assert not chat.send_button.isEnabled()


STORY = ("The castle stood on a hill above the river, and every night its towers caught the "
         "last of the light. ")


def stream_reply(qtbot, chat, rid, lines=30):
    """A long reply in many small batches, as the bridge delivers them, then its end."""
    for n in range(1, lines + 1):
        chat.on_deltas([delta(rid, STORY + ("\n" if n % 3 == 0 else ""), n)])
    chat.on_deltas([delta(rid, "The end.", lines + 1, finished=True, finish_reason="stop")])


def last_line_visible(view):
    """The end of the transcript lies inside the visible part of the view."""
    end = view.textCursor()
    end.movePosition(end.MoveOperation.End)
    rect = view.cursorRect(end)
    return view.viewport().rect().contains(rect.center())


def small_chat(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.render_interval_s = 0  # every batch renders: scrolling is what is tested here
    chat.resize(420, 360)
    chat.show()
    qtbot.waitExposed(chat)
    return chat


def test_long_transcript_keeps_following_new_replies(qtbot):
    chat = small_chat(qtbot)
    view = chat.conversation()
    for i in range(3):
        rid, _, _ = send(qtbot, chat, f"Write a long story about a castle, part {i}.")
        stream_reply(qtbot, chat, rid)
        qtbot.wait(1)
    bar = view.verticalScrollBar()
    assert bar.maximum() > 5 * view.viewport().height()  # far taller than the view
    rid, _, _ = send(qtbot, chat, "And another one.")
    for n in range(1, 12):
        chat.on_deltas([delta(rid, STORY + "\n", n)])
        qtbot.wait(1)
        assert last_line_visible(view), f"the reply ran below the view after batch {n}"
    chat.on_deltas([delta(rid, "Fin.", 12, finished=True, finish_reason="stop")])
    qtbot.wait(1)
    assert last_line_visible(view)
    assert view.toPlainText().rstrip().endswith("stop: stop · copy reply")


def test_user_who_scrolled_up_is_not_pulled_down(qtbot):
    chat = small_chat(qtbot)
    view = chat.conversation()
    rid, _, _ = send(qtbot, chat, "Write a long story about a castle.")
    for n in range(1, 20):
        chat.on_deltas([delta(rid, STORY + "\n", n)])
    qtbot.wait(1)
    bar = view.verticalScrollBar()
    bar.setValue(bar.maximum() // 3)  # the user scrolls up to reread
    held = bar.value()
    for n in range(20, 40):
        chat.on_deltas([delta(rid, STORY + "\n", n)])
        qtbot.wait(1)
    assert bar.value() == held and not last_line_visible(view)
    bar.setValue(bar.maximum())  # back to the bottom: following resumes
    for n in range(40, 50):
        chat.on_deltas([delta(rid, STORY + "\n", n)])
        qtbot.wait(1)
    assert last_line_visible(view)


def click_text(qtbot, view, needle):
    """A left click on the middle of the first occurrence of needle in the transcript."""
    cursor = view.document().find(needle)
    assert not cursor.isNull(), needle
    cursor.setPosition(cursor.selectionStart() + len(needle) // 2)
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton,
                     pos=view.cursorRect(cursor).center())


def test_click_on_a_replys_body_or_stats_selects_it(qtbot):
    chat = small_chat(qtbot)
    view = chat.conversation()
    rid1, _, _ = send(qtbot, chat, "first question")
    chat.on_deltas([delta(rid1, "Towers and moats", 1, finished=True, finish_reason="stop",
                          ttft_s=0.02)])
    rid2, _, _ = send(qtbot, chat, "second question")
    chat.on_deltas([delta(rid2, "Dragons and knights", 1)])  # still streaming
    view.verticalScrollBar().setValue(0)
    qtbot.wait(1)
    with qtbot.waitSignal(chat.requestSelected) as sig:
        click_text(qtbot, view, "Towers and moats")
    assert sig.args == [rid1]
    with qtbot.waitSignal(chat.requestSelected) as sig:
        click_text(qtbot, view, "TTFT 20 ms")  # the stats line belongs to the reply too
    assert sig.args == [rid1]
    with qtbot.waitSignal(chat.requestSelected) as sig:
        click_text(qtbot, view, "Dragons and")
    assert sig.args == [rid2]
    with qtbot.assertNotEmitted(chat.requestSelected):
        click_text(qtbot, view, "second question")  # the user's own text selects nothing
    # The user's message after a reply is not part of it: new text is plain again.
    chat.on_deltas([delta(rid2, " end", 2, finished=True, finish_reason="stop")])
    rid3, _, _ = send(qtbot, chat, "third question")
    assert not view.document().find("third question").charFormat().isAnchor()
