"""Speculative decoding in words for the status bar and each chat reply (issue 31)."""
from __future__ import annotations


def acceptance_text(num_drafts: int, num_accepted: int) -> str:
    """"drafts: 2.4 tokens/verify" (vLLM's mean acceptance length: 1 + accepted / drafts)."""
    return f"drafts: {1 + num_accepted / max(1, num_drafts):.2f} tokens/verify"


def engine_spec_text(stats) -> str:
    """The status bar's part: "" with speculation off and nothing drafted yet."""
    drafts = getattr(stats, "spec_num_drafts", 0)
    if getattr(stats, "spec_method", "off") == "off" and not drafts:
        return ""
    if not drafts:
        return " · n-gram drafts on"
    return " · " + acceptance_text(drafts, getattr(stats, "spec_num_accepted_tokens", 0))
