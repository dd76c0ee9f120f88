"""Drafts for speculative-decoding tests that know the answer and err on purpose.

A tiny random model rarely repeats its context, so n-gram drafts would almost never be
accepted and the accept paths would go untested. The oracle drafts the reference greedy
continuation (from a run without speculation) and corrupts a pseudo-random share of the
drafted tokens, so verifies accept runs of every length, reject at every position, and
sometimes accept the whole draft.
"""
from __future__ import annotations

import numpy as np


class Oracle:
    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int,
                 error_rate: float = 0.3, seed: int = 0) -> None:
        self.references = references  # prompt -> its reference output token ids
        self.vocab = vocab
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def __call__(self, tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
        self.calls += 1
        seq = tokens.tolist()
        for prompt, ref in self.references.items():
            n = len(prompt)
            if tuple(seq[:n]) == prompt and seq[n:] == ref[:len(seq) - n]:
                draft = list(ref[len(seq) - n:len(seq) - n + k])
                wrong = self.rng.random(len(draft)) < self.error_rate
                return [(t + 1) % self.vocab if w else t for t, w in zip(draft, wrong, strict=True)]
        return []

    def matched(self, tokens: np.ndarray, min_n: int, max_n: int,
                k: int) -> tuple[list[int], int]:
        """As engine.spec_decode.ngram.propose_matched: the draft and a match length (max_n)."""
        draft = self(tokens, min_n, max_n, k)
        return draft, max_n if draft else 0
