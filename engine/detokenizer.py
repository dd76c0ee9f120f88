"""Incremental detokenisation: text deltas that never split a multi-byte character.

Decoding only the newest token loses the spaces and merges a tokenizer applies in context, so
each delta is the difference between decoding a short window with and without the new tokens;
while the window ends in an incomplete UTF-8 sequence (U+FFFD) nothing is emitted yet.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvscope.engine.sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def decode_delta(decode: Callable[[list[int]], str], seq: Sequence) -> str:
    """decode: a Decoder (or any ids -> text without special tokens)."""
    ids = seq.token_ids
    before = decode(ids[seq.prefix_offset:seq.read_offset])
    after = decode(ids[seq.prefix_offset:])
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    return after[len(before):]


class Decoder:
    """ids -> text without special tokens, built once per tokenizer.

    A fast tokenizer that does no clean-up of spaces decodes through its Rust core directly:
    the same text at a third of the cost. Single tokens are memoised: once a sequence emits
    every step, the window before the new token is exactly the previous token, so this halves
    the decoder calls, and decoding is a pure function of the ids.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        core = getattr(tokenizer, "_tokenizer", None)
        self._decode: Callable[[list[int]], str]
        if core is not None and hasattr(core, "decode") \
                and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            # skip_special_tokens passed by position: the Rust binding parses keywords slower.
            self._decode = lambda ids: core.decode(ids, True)
        else:
            self._decode = lambda ids: _text(tokenizer.decode(ids, skip_special_tokens=True))
        self._single: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> str:
        if len(ids) != 1:
            return self._decode(ids)
        text = self._single.get(ids[0])
        if text is None:
            text = self._single[ids[0]] = self._decode(ids)
        return text


def _text(decoded: str | list[str]) -> str:
    """decode()'s result for one list of ids (typed for a batch too)."""
    if not isinstance(decoded, str):
        raise TypeError(f"decoding one list of ids gave {type(decoded).__name__}, not text")
    return decoded


def decode_rest(decode: Callable[[list[int]], str], seq: Sequence, emitted: str) -> str:
    """At the end: whatever the window still holds back (e.g. a final incomplete character).
    decode: as for decode_delta."""
    full = decode(seq.output_token_ids)
    return full[len(emitted):] if full.startswith(emitted) else ""
