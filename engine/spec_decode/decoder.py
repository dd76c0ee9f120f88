"""Speculative decoding from the context: draft, verify in the same step, roll back.

The engine's step calls three hooks (engine.llm_engine):
- `draft(batch, ...)` after the scheduler, in a step of decodes only: each decode that wants
  it gets up to K tokens from engine.spec_decode.ngram, appended to its token_ids for the step's
  forward; its scheduled item grows by them (they count against what is left of the step's
  token budget) and its block table grows by the blocks they need (truly free ones only: a
  draft never preempts anyone nor evicts the prefix cache). The model runner returns the
  logits at every drafted position; a row of K + 1 queries with past context is a prefill
  chunk to the attention.
- `verify(engine, logits, sampling)` instead of the plain sample: engine.spec_decode.verify accepts
  a prefix of each draft; the drafts leave token_ids, the accepted tokens and the bonus are
  appended one by one through the engine's ordinary path (stops, max_tokens and stop strings
  land inside a run exactly where they would without drafts); num_computed_tokens stops at
  the last accepted one, the blocks that held only rejected slots are released, and the
  prefix cache registers only blocks filled by accepted tokens.
- `end_step(...)` times the step for engine.spec_decode.backoff.

Drafts never outlive a step: preemption, abort and reconfigure, all between steps, see
sequences exactly as without speculation.
"""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.outputs import TokenDelta
from kvscope.engine.sampler import sample
from kvscope.engine.scheduling.scheduler import ScheduledSeq
from kvscope.engine.sequence import Sequence
from kvscope.engine.spec_decode.backoff import Acceptance, BackOff
from kvscope.engine.spec_decode.ngram import TokenBuffer, propose_matched
from kvscope.engine.spec_decode.verify import accept_greedy, accept_sampled

# The EngineConfig fields only speculation reads: a reconfigure of these alone applies them
# in place, as the scheduling ones.
SPEC_SETTINGS = frozenset({"speculative_method", "num_speculative_tokens",
                           "prompt_lookup_min", "prompt_lookup_max"})
ROLLED_BACK_BACKLOG = 4096  # blocks remembered between two blocks frames


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's spec_decode metrics: verifies with a draft, drafted tokens,
    accepted ones, and accepted ones by position in the draft."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify: 1 (the bonus) + accepted drafts per draft (vLLM's measure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class Verified:
    """One request's verify in a step (traces, the block map)."""
    request_id: str
    drafted: int
    accepted: int
    rolled_back_slots: list[int]


@dataclass(slots=True)
class _Outcome:
    seq: Sequence
    draft: list[int]
    tokens: list[int]


class SpecDecoder:
    def __init__(self, config: EngineConfig) -> None:
        self.method = "off"
        self.k, self.min_n, self.max_n = 4, 2, 4
        self.configure(config)
        self.counters = SpecCounters()
        self.backoff = BackOff()
        self.drafts: dict[Sequence, list[int]] = {}  # this step's
        self._matches: dict[Sequence, int] = {}  # this step's drafts' n-gram lengths
        self.last_step: list[Verified] = []  # the last step's verifies
        self._buffers: dict[Sequence, TokenBuffer] = {}
        self._per_request: dict[Sequence, tuple[int, int]] = {}  # (drafts, accepted)
        self._acceptance: dict[Sequence, Acceptance] = {}  # the back-off's, per request
        # Blocks that held drafted-and-rolled-back slots since the last blocks frame took them.
        self.rolled_back_blocks: set[int] = set()
        self._t0 = 0.0
        self._pure = False
        self._batch_size = 0

    def configure(self, config: EngineConfig) -> None:
        self.method = config.speculative_method
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    @property
    def enabled(self) -> bool:
        return self.method == "ngram"

    # -- before the forward ----------------------------------------------------------------
    def draft(self, batch: list[ScheduledSeq], bm: BlockManager, budget: int,
              max_model_len: int, min_position: int = 0) -> bool:
        """Extend the batch's decodes with drafts; True if any was drafted. `budget`: the
        step's token budget; `min_position`: no draft before it (the anchor tokens)."""
        self._t0 = time.perf_counter()
        self.drafts = {}
        self._matches = {}
        self.last_step = []
        self._batch_size = len(batch)
        self._pure = all(_is_decode(item) for item in batch)
        # A step that carries a prompt chunk drafts nothing: the back-off measures what drafts
        # cost in pure decode steps only, and beside a chunk the step runs kernel by kernel,
        # where 8 streams of quotes with drafts in such steps ran at 0.87x of no drafts.
        if not self.enabled or not self._pure \
                or not self.backoff.should_speculate(len(batch), 1.0 + self.k):
            return False
        budget -= sum(item.num_tokens for item in batch)
        free = len(bm.free_blocks)
        bs = bm.block_size
        for item in batch:
            if budget <= 0:
                break
            seq = item.seq
            # A penalty depends on the tokens before each drafted position, which verify's
            # rows do not apply: penalised requests decode one token at a time.
            if not seq.params.speculative or seq.params.penalized:  # all decodes (_pure)
                continue
            n = len(seq.token_ids)
            k = min(self.k, budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                    max_model_len - n)
            if k < 1 or n < min_position:
                continue
            draft, match = propose_matched(self._buffer(seq).view(seq.token_ids),
                                           self.min_n, self.max_n, k)
            # Only a match as long as the proposer looks for speaks for a request whose own
            # drafts did not pay: 2-grams turn up in any chat (1.7 tokens a verify, 4-grams
            # 4.2 in the quote workload).
            if not self.backoff.pays(len(batch), self._acceptance_of(seq), 1.0 + self.k,
                                     match if draft else 0, match == self.max_n):
                continue
            room = (len(seq.block_table) + free) * bs - n  # slots without taking cached blocks
            del draft[max(0, room):]
            if not draft:
                continue
            need = -(-(n + len(draft)) // bs) - len(seq.block_table)
            if need > 0:
                bm.append_blocks(seq, need)
                free -= need
            seq.token_ids.extend(draft)
            item.num_tokens += len(draft)
            item.num_draft_tokens = len(draft)
            budget -= len(draft)
            self.drafts[seq] = draft
            self._matches[seq] = match
        self._prune()
        return bool(self.drafts)

    def _buffer(self, seq: Sequence) -> TokenBuffer:
        buf = self._buffers.get(seq)
        if buf is None:
            buf = self._buffers[seq] = TokenBuffer()
        return buf

    def _acceptance_of(self, seq: Sequence) -> Acceptance:
        got = self._acceptance.get(seq)
        if got is None:
            got = self._acceptance[seq] = Acceptance()
        return got

    def _prune(self) -> None:
        if len(self._buffers) > 64 and any(s.is_finished for s in self._buffers):
            self._buffers = {s: b for s, b in self._buffers.items() if not s.is_finished}
            self._per_request = {s: c for s, c in self._per_request.items()
                                 if not s.is_finished}
        if len(self._acceptance) > 64:
            self._acceptance = {s: a for s, a in self._acceptance.items() if not s.is_finished}

    def abandon(self, batch: list[ScheduledSeq], bm: BlockManager) -> None:
        """Take this step's drafts back out (the forward failed): as if never drafted."""
        for item in batch:
            draft = self.drafts.get(item.seq)
            if draft:
                seq = item.seq
                del seq.token_ids[len(seq.token_ids) - len(draft):]
                item.num_tokens -= len(draft)
                item.num_draft_tokens = 0
                bm.truncate(seq, -(-len(seq.token_ids) // bm.block_size))
        self.drafts = {}

    # -- after the forward -----------------------------------------------------------------
    def verify(self, engine: SpecEngine, logits: torch.Tensor,
               sampling: list[Sequence]) -> list[TokenDelta]:
        """Sample the plain rows, accept or reject each draft; the step's token deltas."""
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        outcomes: list[_Outcome] = []
        row = 0
        for seq in sampling:
            draft = self.drafts.get(seq)
            if draft is None:
                plain.append(seq)
                plain_rows.append(row)
                row += 1
                continue
            rows = logits[row:row + len(draft) + 1]
            row += len(draft) + 1
            tokens = accept_greedy(rows, draft) if seq.params.greedy else \
                accept_sampled(rows, draft, seq.params, seq.generator)
            outcomes.append(_Outcome(seq, draft, tokens))
        deltas: list[TokenDelta] = []
        if plain:
            deltas += engine._append_tokens(plain, sample(logits[plain_rows], plain))
        deltas += [self._commit(engine, o) for o in outcomes]
        self.drafts = {}
        return deltas

    def _commit(self, engine: SpecEngine, o: _Outcome) -> TokenDelta:
        """Roll the draft back, then append the accepted tokens and the bonus one by one."""
        seq, draft, tokens = o.seq, o.draft, o.tokens
        n = len(seq.token_ids) - len(draft)
        del seq.token_ids[n:]
        seq.num_computed_tokens = n
        accepted = len(tokens) - 1
        self._count(len(draft), accepted)
        drafts_so_far, accepted_so_far = self._per_request.get(seq, (0, 0))
        self._per_request[seq] = (drafts_so_far + 1, accepted_so_far + accepted)
        acceptance = self._acceptance_of(seq)
        if acceptance.tokens_per_verify is None:
            self.backoff.first_verified(len(tokens))
        acceptance.verified(len(tokens))
        self.backoff.match_verified(self._matches.get(seq, 0), len(tokens))
        bm = engine.block_manager
        bs = bm.block_size
        rolled = [seq.block_table[p // bs] * bs + p % bs
                  for p in range(n + accepted, n + len(draft))]
        self.last_step.append(Verified(seq.request_id, len(draft), accepted, rolled))
        if len(self.rolled_back_blocks) < ROLLED_BACK_BACKLOG:
            self.rolled_back_blocks.update(s // bs for s in rolled)
        out = TokenDelta(seq.request_id, [], "")
        for j, token in enumerate(tokens):
            if j:
                seq.num_computed_tokens += 1  # the previous token's K/V was verified
            d = engine._append_tokens([seq], [token])[0]
            out.token_ids += d.token_ids
            out.text += d.text
            if d.finished:
                out.finished, out.finish_reason = True, d.finish_reason
                return out  # finished: the scheduler released every block
        bm.truncate(seq, -(-seq.num_computed_tokens // bs))
        bm.commit_full_blocks(seq, n, seq.num_computed_tokens)
        return out

    def _count(self, drafted: int, accepted: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
        if len(c.accepted_per_pos) < drafted:
            c.accepted_per_pos += [0] * (drafted - len(c.accepted_per_pos))
        for i in range(accepted):
            c.accepted_per_pos[i] += 1

    def stats_fields(self) -> dict[str, Any]:
        """The EngineStats spec_* fields."""
        c = self.counters
        return {"spec_method": self.method, "spec_num_drafts": c.num_drafts,
                "spec_num_draft_tokens": c.num_draft_tokens,
                "spec_num_accepted_tokens": c.num_accepted_tokens,
                "spec_accepted_per_pos": list(c.accepted_per_pos)}

    def take_rolled_back(self) -> list[int]:
        """The blocks that held rolled-back draft slots since the last call (blocks frames)."""
        out = sorted(self.rolled_back_blocks)
        self.rolled_back_blocks = set()
        return out

    def delta_fields(self, seq: Sequence) -> dict[str, int]:
        """The ipc Delta's per-request counters: verifies with a draft, accepted drafts."""
        drafts, accepted = self._per_request.get(seq, (0, 0))
        return {"num_drafts": drafts, "num_accepted_tokens": accepted}

    def end_step(self, num_tokens_out: int) -> None:
        """Time a pure-decode step for the back-off (mixed steps measure the prefill)."""
        if self._pure and self.enabled:
            self.backoff.record(self._batch_size, len(self.last_step), num_tokens_out,
                                time.perf_counter() - self._t0)


def _is_decode(item: ScheduledSeq) -> bool:
    seq = item.seq
    return item.num_tokens == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1 \
        and len(seq.token_ids) > len(seq.prompt_token_ids)


def logit_rows(batch: Seq[ScheduledSeq], starts: Seq[int]) -> list[int]:
    """The rows of the flattened step whose logits are wanted: every drafted position of a
    drafted sequence (its last K + 1 rows), the last row of every other one that samples."""
    rows: list[int] = []
    for i, item in enumerate(batch):
        end = starts[i + 1]
        if item.num_draft_tokens:
            rows.extend(range(end - 1 - item.num_draft_tokens, end))
        elif item.seq.num_computed_tokens + item.num_tokens == len(item.seq.token_ids):
            rows.append(end - 1)
    return rows


class SpecEngine(Protocol):
    """What verify needs of engine.llm_engine.LLMEngine (a protocol: no import circle)."""
    block_manager: BlockManager

    def _append_tokens(self, seqs: list[Sequence], tokens: list[int]) -> list[TokenDelta]: ...
