"""Chat replies as Markdown (tables, highlighted code with Copy), streaming that re-renders only
the reply's tail, regenerate and edit, held sends while the engine loads, the context meter."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QGuiApplication, QTextTable

from kvscope.app.chat.highlight import COLORS
from kvscope.app.chat.markdown import stable_end
from kvscope.app.chat.panel import ChatPanel
from kvscope.app.chat.turn import HELD
from kvscope.ipc.messages import Delta
from kvscope.testing.frames import blocks_frame

REPLY = """## Sizes

| dtype | bytes |
|-------|------:|
| bf16  | 2     |
| int8  | 1     |

Use **int8** with *care*, see [the docs](https://example.com).

```python
def kv_bytes(n):
    return 2 * n  # keys and values
```
"""


def delta(rid, text, n, **kw):
    return Delta(request_id=rid, token_ids=[1], text=text, num_output_tokens=n,
                 num_prompt_tokens=12, **kw)


def panel(qtbot):
    chat = ChatPanel()
    qtbot.addWidget(chat)
    return chat


def ask(chat, text="question"):
    chat.input.setPlainText(text)
    return chat.send()


def frames(doc):
    out, stack = [], [doc.rootFrame()]
    while stack:
        f = stack.pop()
        out.append(f)
        stack += f.childFrames()
    return out


def test_a_finished_reply_renders_a_table_and_highlighted_code(qtbot):
    chat = panel(qtbot)
    rid = ask(chat)
    chat.on_deltas([delta(rid, REPLY, 30, finished=True, finish_reason="stop")])
    view = chat.conversation()
    doc = view.document()
    tables = [f for f in frames(doc) if isinstance(f, QTextTable)]
    assert len(tables) == 1 and (tables[0].rows(), tables[0].columns()) == (3, 2)
    assert tables[0].cellAt(2, 0).firstCursorPosition().block().text() == "int8"
    text = view.toPlainText()
    assert "|" not in text and "```" not in text and "**" not in text  # no raw markdown
    heading = doc.find("Sizes").block()
    assert heading.blockFormat().headingLevel() == 2
    assert doc.find("int8", doc.find("Use").position()).charFormat().fontWeight() >= 600
    assert doc.find("the docs").charFormat().anchorHref() == "https://example.com"
    code = doc.find("def kv_bytes")
    font = code.charFormat()
    assert font.fontFixedPitch() or "mono" in font.fontFamilies()[0].lower()
    keyword = doc.find("return", code.position())
    assert keyword.charFormat().foreground().color().name() == COLORS["keyword"]
    comment = doc.find("# keys and values")
    assert comment.charFormat().foreground().color().name() == COLORS["comment"]
    assert view.code_blocks == ["def kv_bytes(n):\n    return 2 * n  # keys and values"]
    copy = doc.find("Copy")
    assert copy.charFormat().anchorHref() == "copy-code:0"
    view.anchorClicked.emit(copy.charFormat().anchorHref())
    assert QGuiApplication.clipboard().text() == view.code_blocks[0]
    view.anchorClicked.emit("copy-reply:1")
    assert QGuiApplication.clipboard().text() == REPLY


def test_stable_end_never_cuts_inside_a_fence():
    text = "para one\n\n```\ncode\n\nmore code\n"
    assert stable_end(text) == len("para one\n\n")
    assert stable_end(text + "```\n") == len(text + "```\n")
    assert stable_end("no newline yet") == 0
    long = "word " * 500 + "\n" + "tail"  # one long paragraph: cut at its last line end
    assert stable_end(long, max_tail=100) == len(long) - len("tail")


def test_streaming_renders_each_complete_block_once_and_only_the_tail_again(qtbot):
    chat = panel(qtbot)
    chat.render_interval_s = 0  # every batch renders: the view's own economy is tested here
    rid = ask(chat)
    view = chat.conversation()
    doc = view.document()
    paragraphs = [f"Paragraph {i} has a few words in it." for i in range(8)]
    stream = "\n\n".join(paragraphs)
    pieces = [stream[i:i + 7] for i in range(0, len(stream), 7)]
    changed = []
    doc.contentsChange.connect(lambda pos, removed, added: changed.append(pos))
    earliest_allowed = []
    for n, piece in enumerate(pieces, 1):
        changed.clear()
        before = view.renderer.renders
        chat.on_deltas([delta(rid, piece, n)])
        assert view.renderer.renders - before <= 2  # the newly complete block, the tail
        if earliest_allowed:
            assert min(changed) >= earliest_allowed[-1]  # rendered blocks stay untouched
        earliest_allowed.append(view._tail_start)
    # Every paragraph but the last was committed once; the tail is the last one.
    assert view._committed == len(stream) - len(paragraphs[-1])
    assert view.toPlainText().rstrip().endswith(paragraphs[-1])
    before = view.renderer.renders
    chat.on_deltas([delta(rid, "", len(pieces) + 1, finished=True, finish_reason="stop")])
    assert view.renderer.renders == before + 1  # the finished reply: rendered whole once
    # A finished reply is not touched by the next one's streaming.
    end_of_first = doc.characterCount()
    rid2 = ask(chat, "again")
    changed.clear()
    chat.on_deltas([delta(rid2, "Another\n\nreply", 1)])
    assert min(changed) >= end_of_first - 1


def test_regenerate_replaces_the_last_reply(qtbot):
    chat = panel(qtbot)
    rid = ask(chat, "first")
    chat.on_deltas([delta(rid, "old answer", 2, finished=True, finish_reason="stop")])
    assert chat.regenerate_button.isEnabled()
    with qtbot.waitSignal(chat.submitRequested) as sig:
        new = chat.regenerate()
    assert sig.args[0] == new != rid
    assert sig.args[1] == [{"role": "user", "content": "first"}]
    assert "old answer" not in chat.conversation().toPlainText()
    chat.on_deltas([delta(new, "new answer", 2, finished=True, finish_reason="stop")])
    assert chat.conversation().messages == [{"role": "user", "content": "first"},
                                            {"role": "assistant", "content": "new answer"}]


def test_edit_continues_from_the_edited_message_and_drops_the_rest(qtbot):
    chat = panel(qtbot)
    for q, a in (("one", "uno"), ("two", "dos")):
        rid = ask(chat, q)
        chat.on_deltas([delta(rid, a, 1, finished=True, finish_reason="stop")])
    view = chat.conversation()
    view.anchorClicked.emit("edit:2")  # the user's second message
    assert chat.input.toPlainText() == "two" and chat.edit_label.isVisibleTo(chat)
    assert "discarded" in chat.edit_label.text()
    chat.input.setPlainText("three")
    with qtbot.waitSignal(chat.submitRequested) as sig:
        chat.send()
    assert sig.args[1] == [{"role": "user", "content": "one"},
                           {"role": "assistant", "content": "uno"},
                           {"role": "user", "content": "three"}]
    assert "dos" not in view.toPlainText() and not chat.edit_label.isVisibleTo(chat)


def test_a_message_sent_while_loading_is_held_then_sent(qtbot):
    chat = panel(qtbot)
    chat.set_engine_loading("the engine is starting")
    assert chat.send_button.isEnabled() and "queued" in chat.send_button.toolTip()
    with qtbot.assertNotEmitted(chat.submitRequested):
        rid = ask(chat, "early bird")
    assert chat.turns[rid].phase == HELD and chat.input.toPlainText() == ""
    chat.refresh_labels()
    assert "queued until the engine is ready" in chat.phase_label.text()
    with qtbot.waitSignal(chat.submitRequested) as sig:
        chat.set_engine_alive(True)
    assert sig.args[0] == rid and sig.args[1] == [{"role": "user", "content": "early bird"}]
    assert chat.turns[rid].phase == "sending"


def test_stop_drops_a_held_message_without_sending(qtbot):
    chat = panel(qtbot)
    chat.set_engine_loading()
    rid = ask(chat, "never mind")
    chat.stop()
    assert chat.turns[rid].done
    with qtbot.assertNotEmitted(chat.submitRequested):
        chat.set_engine_alive(True)


def test_sampling_carries_penalties_and_the_context_meter_counts(qtbot):
    chat = panel(qtbot)
    chat.settings.repetition_penalty.setValue(1.3)
    chat.settings.presence_penalty.setValue(0.5)
    chat.set_context_limit(2048)
    chat.input.setPlainText("hello")
    with qtbot.waitSignal(chat.submitRequested) as sig:
        rid = chat.send()
    sampling = sig.args[2]
    assert sampling["repetition_penalty"] == 1.3 and sampling["presence_penalty"] == 0.5
    assert "seed" not in sampling and "stop" not in sampling  # unset: not sent
    chat.on_deltas([delta(rid, "hi", 5)])
    chat.on_blocks(blocks_frame(64, 16, {rid: [4, 5, 6]}))
    chat.refresh_labels()
    assert chat.context_label.text() == "context 17 / 2,048 tok · 3 KV blocks held"
    chat.on_deltas([delta(rid, "!", 6, finished=True, finish_reason="stop")])
    chat.refresh_labels()
    assert chat.context_label.text() == "context 18 / 2,048 tok · 0 KV blocks held"


def test_a_streaming_reply_renders_at_most_render_hz(qtbot):
    """Re-rendering the reply's tail (a code block's highlighting, the transcript's repaint)
    on every batch of deltas was most of the window's cost while a reply streamed: batches
    closer than 1/RENDER_HZ only keep their text, which the next due batch or the label clock
    (flush_replies) draws; the finished reply is drawn at once."""
    from kvscope.app.chat.panel import RENDER_HZ

    chat = panel(qtbot)
    now = [100.0]
    chat.clock = lambda: now[0]
    rid = ask(chat)
    view = chat.conversation()
    renders = view.renderer.renders
    chat.on_deltas([delta(rid, "```python\nx = 1\n", 1)])
    assert view.renderer.renders == renders + 1 and "x = 1" in view.toPlainText()
    now[0] += 0.5 / RENDER_HZ
    chat.on_deltas([delta(rid, "y = 2\n", 2)])
    assert view.renderer.renders == renders + 1 and "y = 2" not in view.toPlainText()
    chat.flush_replies()  # the label clock's turn: what arrived is drawn
    assert "y = 2" in view.toPlainText()
    renders = view.renderer.renders
    now[0] += 0.1 / RENDER_HZ
    chat.on_deltas([delta(rid, "z = 3\n", 3)])
    assert view.renderer.renders == renders  # too soon after the flush's render
    now[0] += 0.1 / RENDER_HZ
    chat.on_deltas([delta(rid, "```\n", 4, finished=True, finish_reason="stop")])
    assert "z = 3" in view.toPlainText() and view.turn is None  # the end: drawn at once
