"""A request's prompt as one typed value: raw text, a chat conversation or token ids.

Each is checked where it is built (a client, the HTTP handler, the wire's decoder: msgspec runs
`__post_init__` when it decodes), so a request with no prompt, an empty one or two at once is
refused at the edge and the engine thread only sees prompts it can tokenize. What only the
engine knows (the vocabulary's size, max_model_len, the chat template) it checks itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import msgspec


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class TextPrompt(msgspec.Struct, frozen=True):
    """Raw text, tokenized as it is (no chat template)."""
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ValueError("prompt is empty: give at least one character or token")


class ChatPrompt(msgspec.Struct, frozen=True):
    """A conversation; the engine applies the tokenizer's chat template to it."""
    messages: list[ChatMessage]

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("messages is empty: give at least one {role, content} message")
        for i, msg in enumerate(self.messages):
            if not (isinstance(msg, ChatMessage) and isinstance(msg.role, str)
                    and isinstance(msg.content, str)):
                raise ValueError(f"messages[{i}]={msg!r} is invalid: expected a ChatMessage "
                                 "with a string role and content")


class TokenPrompt(msgspec.Struct, frozen=True):
    """Token ids, given to the model as they are."""
    token_ids: list[int]

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, list) or not self.token_ids:
            raise ValueError("token_ids is empty: give at least one token")
        for i, t in enumerate(self.token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"token_ids[{i}]={t!r} is invalid: expected a token id >= 0")


PromptInput = TextPrompt | ChatPrompt | TokenPrompt
PROMPT_FIELDS = ("prompt", "messages", "token_ids")  # how Submit and the HTTP API spell them


def prompt_of(prompt: str | None = None, messages: list[ChatMessage] | None = None,
              token_ids: list[int] | None = None) -> PromptInput:
    """The one prompt of a request that spells it as three optional fields (Submit, the HTTP
    bodies); ValueError unless exactly one is given and it is valid."""
    given = [name for name, value in zip(PROMPT_FIELDS, (prompt, messages, token_ids), strict=True)
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages or token_ids "
                         f"(got {' and '.join(given) or 'none'})")
    if prompt is not None:
        return TextPrompt(prompt)
    if messages is not None:
        return ChatPrompt(messages)
    return TokenPrompt(list(token_ids or ()))


def as_prompt(prompt: PromptInput | str | Sequence[int]) -> PromptInput:
    """The Python API's shorthand (text, or token ids) as a typed prompt."""
    if isinstance(prompt, (TextPrompt, ChatPrompt, TokenPrompt)):
        return prompt
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, Sequence):
        # cast: mypy keeps str in the narrowed type here; TokenPrompt checks every id anyway
        return TokenPrompt(list(cast("Sequence[int]", prompt)))
    raise ValueError(f"prompt {prompt!r} is invalid: expected text, token ids or a "
                     "TextPrompt / ChatPrompt / TokenPrompt")


def prompt_fields(prompt: PromptInput) -> tuple[str | None, list[ChatMessage] | None,
                                                list[int] | None]:
    """(prompt, messages, token_ids) with exactly one set: prompt_of's inverse."""
    if isinstance(prompt, TextPrompt):
        return prompt.text, None, None
    if isinstance(prompt, ChatPrompt):
        return None, prompt.messages, None
    return None, None, prompt.token_ids
