"""A request as the engine sees it: its tokens, how many are in the KV cache, its block table."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# slots: the step reads a few fields of every running sequence several times; inline slots
# are cheaper to reach than a per-object __dict__, most of all with caches cold after the
# model's forward.
@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # Of those, copied back from the KV tiers at the last admission (engine/kv_cache/tiers.py).
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained content hashes of the full blocks, computed once (prefix caching).
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # When the scheduler first gave it a step (queue time = this - arrival_time).
    first_scheduled_time: float | None = None
    # Why it is waiting now: "" (not waiting), "budget", "max_num_seqs", "memory", "preempted".
    wait_reason: str = ""
    generator: Any = None
    # Incremental detokenisation state (see engine/detokenizer.py).
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(0, self.read_offset - 5)

    def reset_for_recompute(self) -> None:
        """Forget everything cached (the pool it lived in is gone); keep the tokens."""
        self.block_table = []
        self.block_hashes = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
