"""The passkey grid's probes: every (length, depth) cell, several seeded keys a cell."""
from __future__ import annotations

from kvscope.engine.measure.kv_probes import Probe
from kvscope.engine.measure.passkey import PasskeyBuilder, draw_key

LENGTHS = [1024, 2048, 4096, 8192]
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
QUICK_LENGTHS = [1024, 4096]
QUICK_DEPTHS = [0.0, 0.5, 1.0]
SEEDS = 2
# The answer: the key's tokens plus one (the "." after it); the key has 5 digits.
EXTRA_TOKENS = 1


def capped_lengths(lengths: list[int], max_model_len: int, answer_tokens: int) -> list[int]:
    """Lengths the model can hold with its answer (8192 -> max_model_len - answer - 1 on an
    8k model), duplicates dropped, order kept."""
    cap = max_model_len - answer_tokens - 1
    out: list[int] = []
    for n in lengths:
        n = min(n, cap)
        if n not in out:
            out.append(n)
    return out


def first_digit(builder: PasskeyBuilder, answer_ids: list[int]) -> int:
    """Index of the answer's first token holding a digit (a tokenizer may split the space)."""
    for i in range(len(answer_ids)):
        if any(ch.isdigit() for ch in builder.decode(answer_ids[i:i + 1])):
            return i
    return 0


def passkey_probes(builder: PasskeyBuilder, lengths: list[int], depths: list[float],
                   seeds: int, seed: int = 0) -> list[Probe]:
    probes = []
    for length in lengths:
        for depth in depths:
            for s in range(seeds):
                prompt = builder.build(length, depth, draw_key(seed, length, depth, s))
                probes.append(Probe(
                    ids=prompt.ids, max_tokens=len(prompt.answer_ids) + EXTRA_TOKENS,
                    cell=(("length", length), ("depth", depth)), key=prompt.key,
                    right=prompt.answer_ids, rank_at=first_digit(builder, prompt.answer_ids)))
    return probes
