"""A chat reply kept streaming on an engine, with the window drawing it or without one: the
two sides of gui_bench's --chat comparison (issue 53's target: the window costs the engine at
most 5 % while a long code-heavy reply streams, with Markdown on).

    python -m benchmarks.window.chat_stream --attach CMD --attach-state STATE \
        (--window | --headless) [--max-tokens N] [--report PATH]

Both sides send the same chat (PROMPT, greedy, --max-tokens) and send it again each time the
reply ends, until they are terminated, so the engine always carries one chat request beside
the benchmark's workload. --window: a real MainWindow (offscreen unless a display is set)
attached to the engine, the message typed into its chat and sent with its Send, so the reply
is rendered as the user would see it (Markdown, highlighted code). --headless: the same
request from a plain ipc.EngineClient, its text dropped. --report PATH: after each reply, a
JSON line with the reply's length, its code blocks and (window) the renders so far.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# The embedded SmolLM2-135M answers this, greedy, with fenced Python blocks and a sentence or
# two between them (a system prompt made it answer in prose).
PROMPT = ("Write a Python class for a paged key-value cache with methods allocate, free, fork "
          "and evict, then a pytest test for each method. Answer with ```python code blocks.")
TEMPERATURE = 0.0


def report_line(path: str | None, **fields) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def code_blocks(text: str) -> int:
    """Fenced blocks, the one still open included (the small model often never closes it:
    the worst case for the window, whose tail is then the whole block)."""
    return (text.count("```") + 1) // 2


def headless(command: str, state: str, max_tokens: int, report: str | None) -> int:
    from kvscope.ipc import EngineClient

    client = EngineClient(command, state)
    messages = [{"role": "user", "content": PROMPT}]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            done = threading.Event()
            text: list[str] = []

            def on_delta(d, text=text, done=done):
                text.append(d.text)
                if d.finished:
                    done.set()

            # As the window's chat sends it: Interactive on (priority -1).
            client.submit(messages, {"max_tokens": max_tokens, "temperature": TEMPERATURE,
                                     "priority": -1}, on_delta=on_delta)
            while not done.wait(0.2) and not stop.is_set():
                pass
            reply = "".join(text)
            report_line(report, side="headless", chars=len(reply), code=code_blocks(reply),
                        ended=done.is_set())
    finally:
        client.close()
    return 0


def window(command: str, state: str, max_tokens: int, report: str | None) -> int:
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from kvscope.app.main_window import MainWindow

    app = QApplication.instance() or QApplication(["chat_stream"])
    folder = tempfile.mkdtemp(prefix="chat_stream-")
    settings = QSettings(str(Path(folder) / "s.ini"), QSettings.Format.IniFormat)
    w = MainWindow(attach=command, attach_state=state, settings=settings)
    w.resize(1600, 900)
    w.show()

    def send() -> None:
        chat = w.chat
        chat.settings.system_prompt.setPlainText("")  # as the headless side: no system prompt
        chat.temperature.setValue(TEMPERATURE)
        chat.max_tokens.setValue(max_tokens)
        chat.input.setPlainText(PROMPT)
        chat.send_button.click()

    def on_deltas(deltas) -> None:
        view = w.chat.conversation()
        if view.turn is None and any(d.finished for d in deltas):
            reply = view.conversation.messages[-1].content if view.conversation.messages else ""
            report_line(report, side="window", chars=len(reply), code=code_blocks(reply),
                        renders=view.renderer.renders, ended=True)
            w.chat.new_conversation()  # a fresh transcript: each reply costs the same
            QTimer.singleShot(0, send)

    w.engineReady.connect(lambda _hello: QTimer.singleShot(0, send))
    w.bridge.deltasReceived.connect(on_deltas)
    # Qt's event loop does not run Python's signal handlers by itself: poll for SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: app.quit())
    poll = QTimer()
    poll.timeout.connect(lambda: None)
    poll.start(200)
    w.start()
    app.exec()
    view = w.chat.conversation()
    if view.turn is not None:  # terminated mid-reply: what it had drawn so far
        report_line(report, side="window", chars=len(view.turn.text),
                    code=code_blocks(view.turn.text), renders=view.renderer.renders,
                    ended=False)
    w.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attach", required=True, metavar="CMD")
    p.add_argument("--attach-state", required=True, metavar="STATE")
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--window", action="store_true")
    side.add_argument("--headless", action="store_true")
    p.add_argument("--max-tokens", type=int, default=768)
    p.add_argument("--report", help="append a JSON line per reply here")
    args = p.parse_args(argv)
    run = window if args.window else headless
    return run(args.attach, args.attach_state, args.max_tokens, args.report)


if __name__ == "__main__":
    sys.exit(main())
