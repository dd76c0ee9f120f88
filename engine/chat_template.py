"""The model's chat template as token ids: one function, so every front end (the CLI, the
ZeroMQ server, the LLM API, the HTTP API) feeds the model exactly the same prompt."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
                    ) -> list[int]:
    """Token ids of `messages` ([{"role", "content"}, ...]) ready for the assistant's reply."""
    # Typed as every mode's result (text, a batch...); with tokenize=True and one conversation
    # it is token ids: a BatchEncoding (a mapping) on transformers >= 5, a plain list before.
    ids: object = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"the chat template gave {type(ids).__name__}, not token ids")
    return list(ids)
