"""Prompt-lookup (n-gram) drafts: the tokens that followed the last occurrence of the context's
suffix earlier in the same request's prompt plus output.

The longest suffix n-gram of length prompt_lookup_min..prompt_lookup_max that occurred before
wins (ties: its earliest occurrence, as vLLM's proposer); the draft is the up to K tokens that
followed it. No match, no draft. Vectorised over the context with numpy: one comparison of
every earlier token with the last one, then at most `max_n - 1` narrowing passes over the
candidates, so a step costs O(length) per request and no Python loop runs over tokens.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

TokenArray = npt.NDArray[np.int64]


def propose(tokens: TokenArray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k drafted tokens following the longest earlier match of tokens' suffix."""
    return propose_matched(tokens, min_n, max_n, k)[0]


def propose_matched(tokens: TokenArray, min_n: int, max_n: int,
                    k: int) -> tuple[list[int], int]:
    """The draft, and the length of the suffix n-gram it follows (0: no draft). A longer
    match is likelier to be copied on (engine.spec_decode.backoff keeps tokens per verify by it)."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return [], 0
    # Candidates j: tokens[j] == tokens[-1], j < length - 1, so at least one token follows.
    cand = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    best, best_n = -1, 0
    n = 1
    while len(cand):
        if n >= min_n:
            best, best_n = int(cand[0]), n  # the earliest occurrence of the longest match
        if n == max_n:
            break
        # Extend every surviving match one token further back.
        cand = cand[cand >= n]
        cand = cand[tokens[cand - n] == tokens[length - 1 - n]]
        n += 1
    if best < 0:
        return [], 0
    draft: list[int] = tokens[best + 1:best + 1 + k].tolist()
    return draft, best_n


class TokenBuffer:
    """A request's tokens as a growing int64 array, extended only by what is new, so the
    proposer does not convert the whole list every step."""

    __slots__ = ("array", "length")

    def __init__(self) -> None:
        self.array: TokenArray = np.empty(64, dtype=np.int64)
        self.length = 0

    def view(self, token_ids: list[int]) -> TokenArray:
        n = len(token_ids)
        if n < self.length:  # never expected (tokens only grow); rebuild rather than trust
            self.length = 0
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length:n] = token_ids[self.length:n]
            self.length = n
        return self.array[:n]
