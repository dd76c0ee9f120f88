"""The typed prompt: exactly one of text, chat messages or token ids, refused where it is
built (Submit, the client) or decoded, before any engine sees it."""
from __future__ import annotations

import msgspec
import pytest

from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.ipc.prompts import (
    ChatMessage,
    ChatPrompt,
    TextPrompt,
    TokenPrompt,
    as_prompt,
    prompt_fields,
    prompt_of,
)

HI = [ChatMessage("user", "hi")]


@pytest.mark.parametrize("fields, words", [
    ({}, "got none"),
    ({"prompt": "x", "token_ids": [1]}, "got prompt and token_ids"),
    ({"prompt": "x", "messages": HI}, "got prompt and messages"),
    ({"prompt": "x", "messages": HI, "token_ids": [1]}, "got prompt and messages and token_ids"),
    ({"prompt": ""}, "prompt is empty"),
    ({"messages": []}, "messages is empty"),
    ({"token_ids": []}, "token_ids is empty"),
    ({"token_ids": [1, -1]}, "token_ids[1]=-1 is invalid"),
    ({"token_ids": [1, True]}, "token_ids[1]=True is invalid"),
    ({"messages": [ChatMessage("user", None)]}, "messages[0]"),  # type: ignore[arg-type]
])
def test_a_bad_prompt_is_refused_where_it_is_built_and_decoded(fields, words):
    with pytest.raises(ValueError) as err:
        prompt_of(**fields)
    assert words in str(err.value)
    with pytest.raises(ValueError, match="exactly one|empty|invalid|messages"):
        m.Submit(id=1, **fields)
    frame = msgspec.msgpack.encode({"type": "submit", "id": 5, **msgspec.to_builtins(fields)})
    with pytest.raises(codec.BadMessage) as bad:
        codec.decode_command(frame)
    assert (bad.value.code, bad.value.call_id) == (m.INVALID, 5)


def test_each_prompt_round_trips_through_submit():
    for prompt in (TextPrompt("hi"), ChatPrompt(HI), TokenPrompt([3, 1, 4])):
        cmd = m.Submit.of(prompt, m.Sampling(max_tokens=2), "r", call_id=9)
        assert cmd.typed_prompt() == prompt and cmd.id == 9
        back = codec.decode_command(codec.encode(cmd))
        assert isinstance(back, m.Submit) and back.typed_prompt() == prompt
        assert prompt_of(*prompt_fields(prompt)) == prompt


def test_the_python_shorthand():
    assert as_prompt("hi") == TextPrompt("hi")
    assert as_prompt([1, 2]) == as_prompt((1, 2)) == TokenPrompt([1, 2])
    assert as_prompt(ChatPrompt(HI)) == ChatPrompt(HI)
    with pytest.raises(ValueError, match="empty"):
        as_prompt([])
    with pytest.raises(ValueError, match="invalid"):
        as_prompt(3)  # type: ignore[arg-type]
