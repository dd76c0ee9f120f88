"""A long chat in a real X server: new replies stay in view, the mouse wheel (sent through the
X server with xdotool) takes the view up without being pulled back, and scrolling back down
follows again; a click on a reply's text selects its request."""
from __future__ import annotations

from PySide6.QtCore import QPoint

from kvscope.app.chat.panel import ChatPanel
from kvscope.ipc.messages import Delta
from tests.app.xvfb import xserver

TITLE = "kvscope-chat-scroll"
STORY = ("The castle stood on a hill above the river, and every night its towers caught the "
         "last of the light.\n")


def delta(rid, text, n, **kw):
    return Delta(request_id=rid, token_ids=[1], text=text, num_output_tokens=n,
                 num_prompt_tokens=12, **kw)


def last_line_visible(view) -> bool:
    end = view.textCursor()
    end.movePosition(end.MoveOperation.End)
    return view.viewport().rect().contains(view.cursorRect(end).center())


def in_window(chat, view, point: QPoint) -> tuple[int, int]:
    """A point of the view's viewport in the top-level window's coordinates (xdotool's)."""
    p = view.viewport().mapTo(chat, point)
    return p.x(), p.y()


def ask(qtbot, chat, text):
    chat.input.setPlainText(text)
    with qtbot.waitSignal(chat.submitRequested) as sig:
        chat.send()
    return sig.args[0]


def stream(qtbot, chat, rid, first, count, check=None):
    for n in range(first, first + count):
        chat.on_deltas([delta(rid, STORY, n)])
        qtbot.wait(5)  # the X server's expose and resize events run in between
        if check is not None:
            check(n)


def test_long_chat_follows_scrolls_and_clicks_in_a_real_x_server(qtbot, x_server):
    chat = ChatPanel()
    chat.render_interval_s = 0  # every batch renders: scrolling is what is tested
    chat.setWindowTitle(TITLE)
    qtbot.addWidget(chat)
    chat.resize(520, 460)
    chat.show()
    qtbot.waitExposed(chat)
    (wid, *_) = xserver.window_ids(title=TITLE)
    view = chat.conversation()
    bar = view.verticalScrollBar()
    for i in range(3):
        rid = ask(qtbot, chat, f"Write a long story about a castle, part {i}.")
        stream(qtbot, chat, rid, 1, 25)
        chat.on_deltas([delta(rid, "The end.", 26, finished=True, finish_reason="stop")])
    assert bar.maximum() > 5 * view.viewport().height()

    def visible(n):
        assert last_line_visible(view), f"the new reply ran below the view at batch {n}"

    rid = ask(qtbot, chat, "And another one.")
    stream(qtbot, chat, rid, 1, 10, visible)

    # The wheel, through the X server: up a few notches, away from the bottom.
    x, y = in_window(chat, view, view.viewport().rect().center())
    xserver.xdotool("mousemove", "--window", wid, str(x), str(y))
    xserver.xdotool("click", "--repeat", "8", "--delay", "20", "4")
    qtbot.waitUntil(lambda: bar.value() < bar.maximum() - 50, timeout=5000)
    qtbot.wait(100)
    held = bar.value()
    stream(qtbot, chat, rid, 11, 10)
    assert bar.value() == held and not last_line_visible(view)  # not pulled down

    # Back to the bottom with the wheel: following resumes.
    xserver.xdotool("click", "--repeat", "80", "--delay", "5", "5")
    qtbot.waitUntil(lambda: bar.value() == bar.maximum(), timeout=5000)
    stream(qtbot, chat, rid, 21, 8, visible)

    # A click on the reply's text (not its header) selects its request.
    cursor = view.document().find("castle stood", view.document().characterCount() - 400)
    assert not cursor.isNull()
    x, y = in_window(chat, view, view.cursorRect(cursor).center())
    with qtbot.waitSignal(chat.requestSelected, timeout=5000) as sig:
        xserver.click(wid, x, y)
    assert sig.args == [rid]
    chat.on_deltas([delta(rid, "Fin.", 30, finished=True, finish_reason="stop")])
