"""One KV setting's answers to a list of probes, scored against float32 KV's.

A probe is a prompt (token ids) and how many tokens to generate. For each KV setting the
probes run batched through the engine (LLMEngine.add_request/step, greedy, ignore_eos, so
every setting answers with the same number of tokens); then each probe is scored
teacher-forced along float32 KV's answer: the log-probs at the answer's positions, which give
the KL from float32 and the rank of the right (or float32's) first token.

The scoring pass reuses the prompt the greedy run just left in the prefix cache: only the last
partial block and the answer are computed again, not the thousands of filler tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvscope.engine.measure.passkey import is_right, rank_of

SCORE_CHUNK = 1024  # rows per forward when the cache no longer holds a prompt


@dataclass
class Probe:
    ids: list[int]
    max_tokens: int
    cell: tuple  # which grid cell the probe counts towards: (length, depth) or a label
    key: int | None = None  # the passkey, when there is a right answer
    # The right answer's tokens, and which of them the rank is of: the key's first digit,
    # not the space before it that any answer starts with. None: float32's first token.
    right: list[int] | None = None
    rank_at: int = 0
    teacher: list[int] | None = None  # score along these tokens, not float32's answer


@dataclass
class Answer:
    tokens: list[int]
    text: str
    log_probs: torch.Tensor = field(repr=False)  # [len(reference), vocab] along the reference
    right_rank: int | None = None  # rank of the right answer's token at probe.rank_at


def greedy_answers(engine, probes: list[Probe], on_step=None) -> list[tuple[list[int], str]]:
    """Every probe's greedy tokens and text, all queued at once so they run batched (and
    share their prefixes in the cache). on_step(engine) after every step: progress."""
    from kvscope.engine import SamplingParams

    ids = [engine.add_request(p.ids, SamplingParams(max_tokens=p.max_tokens, ignore_eos=True))
           for p in probes]
    while engine.has_unfinished():
        engine.step()
        if on_step is not None:
            on_step(engine)
    outs = [engine.pop_output(i) for i in ids]
    return [(list(o.token_ids), o.text) for o in outs]


@torch.inference_mode()
def tail_log_probs(engine, token_ids: list[int], num_rows: int) -> torch.Tensor:
    """[num_rows, vocab] log-softmax of the next-token distribution after each of the last
    num_rows prefixes of token_ids (the last one included), reusing cached prefix blocks."""
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.scheduling.scheduler import ScheduledSeq
    from kvscope.engine.sequence import Sequence

    assert not engine.has_unfinished(), "score on an idle engine"
    bm, runner = engine.block_manager, engine.runner
    seq = Sequence("score-tail", list(token_ids), SamplingParams(max_tokens=1))
    # Cached blocks must stop before the rows we want logits for.
    keep = max(0, (len(token_ids) - num_rows) // bm.block_size)
    hits = bm.match_prefix(seq)[:keep]
    todo = len(token_ids) - len(hits) * bm.block_size
    if not bm.can_allocate(seq, hits, todo):
        raise ValueError(f"{len(token_ids)} tokens do not fit in the KV pool")
    bm.allocate(seq, hits, todo)
    try:
        tail = []
        while seq.num_computed_tokens < len(token_ids):
            n = min(SCORE_CHUNK, len(token_ids) - seq.num_computed_tokens)
            input_ids, positions, meta, _ = runner.prepare([ScheduledSeq(seq, n)])
            hidden = runner.forward(input_ids, positions, meta)
            seq.num_computed_tokens += n
            tail.append(hidden)
        hidden = torch.cat(tail)[-num_rows:]
        logits = engine.model.compute_logits(hidden)
    finally:
        bm.free(seq)
    return torch.log_softmax(logits.float(), dim=-1)


def score_along(engine, probe: Probe, reference: list[int]) -> torch.Tensor:
    """Log-probs at each position of `reference` continuing the probe's prompt."""
    return tail_log_probs(engine, probe.ids + reference[:-1], len(reference))


def answers(engine, probes: list[Probe], references: list[list[int]] | None,
            on_step=None) -> list[Answer]:
    """Greedy answers, scored along `references` (None: along each probe's own answer, which
    is how the float32 reference scores itself)."""
    greedy = greedy_answers(engine, probes, on_step)
    out = []
    for k, (probe, (tokens, text)) in enumerate(zip(probes, greedy, strict=True)):
        ref = probe.teacher or (references[k] if references is not None else tokens)
        out.append(Answer(tokens, text, score_along(engine, probe, ref), right_rank(engine, probe)))
    return out


def right_rank(engine, probe: Probe) -> int | None:
    """Rank of the right answer's token at rank_at, teacher-forced along the right answer."""
    if probe.right is None:
        return None
    upto = probe.right[:probe.rank_at + 1]
    return rank_of(score_along(engine, probe, upto)[probe.rank_at], upto[-1])


def kl(ref_log_probs: torch.Tensor, log_probs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || candidate)."""
    p = ref_log_probs.exp()
    return float((p * (ref_log_probs - log_probs)).sum(-1).mean())


def prefix_share(a: list[int], b: list[int]) -> float:
    """Share of b's positions before the first one where a differs."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / max(len(b), 1)


def outcome(probe: Probe, answer: Answer, reference: Answer) -> dict:
    """What one probe measured for one setting, against float32 KV's answer."""
    rank = answer.right_rank if answer.right_rank is not None \
        else rank_of(answer.log_probs[0], reference.tokens[0])
    result = {
        "same_as_float32": answer.tokens == reference.tokens,
        "agreement": prefix_share(answer.tokens, reference.tokens),
        "top1_agreement": float((answer.log_probs.argmax(-1)
                                 == reference.log_probs.argmax(-1)).float().mean()),
        "kl": kl(reference.log_probs, answer.log_probs),
        "rank": rank,
        "answer": answer.text,
    }
    if probe.key is not None:
        result["key"] = probe.key
        result["right"] = is_right(answer.text, probe.key)
    return result
