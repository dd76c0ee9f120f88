"""Incremental detokenisation: text deltas that never split a multi-byte character.

Decoding only the newest token loses the spaces and merges a tokenizer applies in context, so
each delta is the difference between decoding a short window with and without the new tokens;
while the window ends in an incomplete UTF-8 sequence (U+FFFD) nothing is emitted yet.
"""
from __future__ import annotations

from engine.sequence import Sequence


def decode_delta(tokenizer, seq: Sequence) -> str:
    ids = seq.token_ids
    before = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    after = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=True)
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    return after[len(before):]


def decode_rest(tokenizer, seq: Sequence, emitted: str) -> str:
    """At the end: whatever the window still holds back (e.g. a final incomplete character)."""
    full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    return full[len(emitted):] if full.startswith(emitted) else ""
