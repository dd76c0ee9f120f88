"""The model's chat template as token ids: one function, so every front end (the CLI, the
ZeroMQ server, the LLM API, the HTTP API) feeds the model exactly the same prompt."""
from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` ([{"role", "content"}, ...]) ready for the assistant's reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers >= 5 returns a BatchEncoding here, older versions a plain list.
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
