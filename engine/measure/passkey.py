"""The passkey test of Landmark Attention (Mohtashami & Jaggi, 2023), built in token ids.

An instruction, the filler sentences repeated to the asked length, "The pass key is N.
Remember it." at the asked depth, then the question "What is the pass key? The pass key is",
which the model completes. Every piece is tokenized on its own and the ids are concatenated,
so every prompt of a grid starts with the same ids up to its key: the engine's prefix cache
then computes the shared filler once for every cell, length and seed (only what follows the
key is a cell's own work).
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

Encode = Callable[[str], list[int]]

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
               "memorize them. I will quiz you about the important information there.")
# Landmark's filler, one sentence a piece: the key goes between two of them.
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
QUESTION = "What is the pass key? The pass key is"


def key_sentence(key: int) -> str:
    return f"The pass key is {key}. Remember it."


def draw_key(seed: int, length: int, depth: float, sample: int) -> int:
    """The cell's key: seeded, different per cell and per sample (5 digits, so every key is
    as long as the next)."""
    return random.Random(f"passkey:{seed}:{length}:{depth}:{sample}").randint(10000, 99999)


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]
    key: int
    length: int  # the asked length in tokens; len(ids) is at most this
    depth: float  # 0..1: where the key sits in the filler
    key_start: int  # token index where the key sentence begins
    filler_start: int  # first and one-past-last filler token (the key sentence excluded)
    filler_end: int
    answer_ids: list[int]  # the right completion, tokenized as the model would write it


class PasskeyBuilder:
    """Builds the prompts of one tokenizer; the pieces are tokenized once."""

    def __init__(self, encode: Encode, decode: Callable[[list[int]], str] | None = None
                 ) -> None:
        self.encode = encode
        self.decode = decode or (lambda ids: "")
        self.instruction = encode(INSTRUCTION)
        # A leading space: the pieces follow one another as words in running text would.
        self.sentences = [encode(" " + s) for s in FILLER]
        self.question = encode(" " + QUESTION)

    def filler(self, num_sentences: int) -> list[list[int]]:
        return [self.sentences[i % len(self.sentences)] for i in range(num_sentences)]

    def build(self, length: int, depth: float, key: int) -> PasskeyPrompt:
        """The prompt of at most `length` tokens with the key after round(depth * n) of its
        n filler sentences."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is outside 0..1")
        key_ids = self.encode(" " + key_sentence(key))
        fixed = len(self.instruction) + len(key_ids) + len(self.question)
        if fixed >= length:
            raise ValueError(f"length {length} is too short for a passkey prompt ({fixed} "
                             "tokens without any filler)")
        sentences: list[list[int]] = []
        used = fixed
        while used + len(self.sentences[len(sentences) % len(self.sentences)]) <= length:
            sentences.append(self.sentences[len(sentences) % len(self.sentences)])
            used += len(sentences[-1])
        at = round(depth * len(sentences))
        before = [t for s in sentences[:at] for t in s]
        after = [t for s in sentences[at:] for t in s]
        ids = self.instruction + before + key_ids + after + self.question
        key_start = len(self.instruction) + len(before)
        return PasskeyPrompt(
            ids=ids, key=key, length=length, depth=depth, key_start=key_start,
            filler_start=len(self.instruction),
            filler_end=len(self.instruction) + len(before) + len(after),
            answer_ids=self.encode(" " + str(key)))


def answered_key(text: str) -> int | None:
    """The first whole number in the model's answer ("12345." -> 12345), None without one."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def is_right(text: str, key: int) -> bool:
    return answered_key(text) == key


def rank_of(log_probs_row: list[float] | object, token: int) -> int:
    """1 for the most likely token: how many tokens are strictly more likely, plus one."""
    import torch

    row = torch.as_tensor(log_probs_row)
    return int((row > row[token]).sum()) + 1
