"""Saved chats: restored by a new panel with prompts and settings, crash-safe files, bad
files refused by line, delete with undo, Markdown and JSON export."""
import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from kvscope.app.chat.conversation import BadConversation, read_events
from kvscope.app.chat.panel import ChatPanel
from kvscope.app.chat.store import ChatStore, default_folder
from kvscope.ipc.messages import Delta


def finish(chat, rid, text, n=3):
    chat.on_deltas([Delta(request_id=rid, token_ids=[1] * n, text=text, num_output_tokens=n,
                          num_prompt_tokens=20, finished=True, finish_reason="stop")])


def talk(chat, text, reply):
    chat.input.setPlainText(text)
    rid = chat.send()
    assert rid is not None
    finish(chat, rid, reply)
    return rid


def make(qtbot, folder):
    chat = ChatPanel(ChatStore(folder))
    qtbot.addWidget(chat)
    return chat


def test_the_folder_honours_xdg_data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_folder() == tmp_path / "kvscope" / "chats"


def test_a_new_panel_restores_conversations_prompts_and_settings(qtbot, tmp_path):
    chat = make(qtbot, tmp_path)
    chat.settings.system_prompt.setPlainText("You are terse.")
    chat.temperature.setValue(0.3)
    chat.settings.top_k.setValue(40)
    chat.settings.repetition_penalty.setValue(1.2)
    chat.settings.seed.setValue(7)
    chat.settings.stop.setText("END | \\n\\n")
    talk(chat, "What is a KV cache?", "Keys and values, kept.")
    chat.new_conversation()
    chat.settings.system_prompt.setPlainText("You are a pirate.")
    talk(chat, "Ahoy", "Arr")
    chat.rename_conversation("Pirate talk")
    chat.save()
    chat.store.close()

    again = make(qtbot, tmp_path)  # the next start of the window
    assert again.stack.count() == 2 and not again.warnings
    first, second = again.conversation(0).conversation, again.conversation(1).conversation
    assert first.title == "What is a KV cache?" and second.title == "Pirate talk"
    assert first.system_prompt == "You are terse." and second.system_prompt == "You are a pirate."
    assert [m.content for m in first.messages] == ["What is a KV cache?",
                                                   "Keys and values, kept."]
    s = first.settings
    assert (s.temperature, s.top_k, s.repetition_penalty, s.seed, s.stop) == \
        (pytest.approx(0.3), 40, pytest.approx(1.2), 7, ["END", "\n\n"])
    again.show_conversation(0)
    assert again.settings.top_k.value() == 40 and again.temperature.value() == pytest.approx(0.3)
    # What the restored conversation sends next: its system prompt, transcript, sampling.
    again.input.setPlainText("And paged?")
    with qtbot.waitSignal(again.submitRequested) as sig:
        again.send()
    _, messages, sampling = sig.args
    assert messages[0] == {"role": "system", "content": "You are terse."}
    assert messages[1:] == [{"role": "user", "content": "What is a KV cache?"},
                            {"role": "assistant", "content": "Keys and values, kept."},
                            {"role": "user", "content": "And paged?"}]
    assert sampling["top_k"] == 40 and sampling["seed"] == 7 and sampling["stop"] == ["END", "\n\n"]
    assert "Keys and values, kept." in again.conversation(0).toPlainText()


def test_a_cut_last_line_is_dropped_with_a_warning(qtbot, tmp_path):
    chat = make(qtbot, tmp_path)
    talk(chat, "one", "two")
    talk(chat, "three", "four")
    chat.store.close()
    (path,) = tmp_path.glob("*.jsonl")
    data = path.read_bytes()
    path.write_bytes(data[:-9])  # a crash while the last reply was written
    again = make(qtbot, tmp_path)
    assert len(again.warnings) == 1 and "cut short" in again.warnings[0]
    assert [m.content for m in again.conversation().conversation.messages] == \
        ["one", "two", "three"]
    # The file was rewritten whole: the next append starts on a line of its own.
    again.store.close()
    _, warnings = read_events(path.read_bytes(), path.name)
    assert warnings == []


@pytest.mark.parametrize("line, fault", [
    (b'{"event": "message", "role": "root", "content": "x"}', "role"),
    (b'{"event": "message", "role": "user", "content": "x", "exec": "rm"}', "exec"),
    (b"__import__('os')", "malformed"),
    (b'{"event": "truncate", "keep": 99}', "keep=99"),
])
def test_a_bad_line_refuses_the_file_naming_the_line(tmp_path, line, fault):
    good = (b'{"event":"header","version":1,"id":"a","title":"t","created":1.0}\n'
            b'{"event":"message","role":"user","content":"hi"}\n')
    with pytest.raises(BadConversation, match=f"line 3.*{fault}"):
        read_events(good + line + b"\n", "a.jsonl")


def test_a_refused_file_is_reported_and_left_alone(qtbot, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"event":"header","version":1,"id":"bad","title":"t","created":1.0}\n'
                    b"not json\n")
    chat = make(qtbot, tmp_path)
    assert any("bad.jsonl, line 2" in w for w in chat.warnings)
    assert chat.stack.count() == 1 and bad.exists()


def test_delete_asks_then_undo_brings_it_back(qtbot, tmp_path):
    chat = make(qtbot, tmp_path)
    talk(chat, "keep me", "kept")
    chat.confirm_delete = lambda parent, title: False
    assert not chat.delete_conversation()
    assert chat.stack.count() == 1 and len(list(tmp_path.glob("*.jsonl"))) == 1
    asked = []
    chat.confirm_delete = lambda parent, title: asked.append(title) or True
    assert chat.delete_conversation()
    assert asked == ["keep me"] and not list(tmp_path.glob("*.jsonl"))
    assert chat.undo_row.isVisibleTo(chat) and "keep me" in chat.undo_label.text()
    assert chat.conversation().conversation.messages == []  # a fresh one took its place
    chat.undo_delete()
    assert len(list(tmp_path.glob("*.jsonl"))) == 1
    titles = [chat.sidebar.item(i).text() for i in range(chat.sidebar.count())]
    assert "keep me" in titles
    assert [m.content for m in chat.conversation().conversation.messages] == ["keep me", "kept"]
    chat.store.close()
    assert make(qtbot, tmp_path).conversation(0).conversation.title == "keep me"


def test_a_delete_not_undone_is_gone_at_the_next_start(qtbot, tmp_path):
    chat = make(qtbot, tmp_path)
    talk(chat, "forget me", "ok")
    chat.confirm_delete = lambda parent, title: True
    chat.delete_conversation()
    chat.store.close()
    again = make(qtbot, tmp_path)
    assert again.stack.count() == 1 and again.conversation().conversation.messages == []
    assert not list(tmp_path.iterdir())  # the deleted file was removed


def test_export_markdown_and_json(qtbot, tmp_path):
    chat = make(qtbot, tmp_path / "chats")
    chat.settings.system_prompt.setPlainText("Be brief.")
    talk(chat, "Show code", "Here:\n\n```python\nprint(1)\n```\n")
    chat.export(tmp_path / "out.md", "markdown")
    chat.export(tmp_path / "out.json", "json")
    md = (tmp_path / "out.md").read_text()
    assert md.startswith("# Show code\n")
    assert "**System:**\n\nBe brief." in md
    assert "**You:**\n\nShow code" in md
    assert "**Assistant:**\n\nHere:\n\n```python\nprint(1)\n```" in md
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["title"] == "Show code" and doc["system_prompt"] == "Be brief."
    reply = "Here:\n\n```python\nprint(1)\n```\n"
    assert doc["messages"] == [{"role": "user", "content": "Show code"},
                               {"role": "assistant", "content": reply}]
    assert doc["settings"]["temperature"] == pytest.approx(chat.temperature.value())
