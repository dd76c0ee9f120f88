"""What the engine hands back: each step's result (its batch and token deltas) and finished
request outputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.scheduling.scheduler import ScheduledSeq


@dataclass
class TokenDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one LLMEngine.step() did, handed on explicitly (as vLLM hands on its
    SchedulerOutput): the batch it ran and the token deltas that came out of it.

    scheduled is empty when no model step ran (nothing had work); outputs may still hold
    the finishes of requests that could never fit the pool."""
    outputs: list[TokenDelta]
    scheduled: list[ScheduledSeq]

    @property
    def ran(self) -> bool:
        """Whether a model step ran (LLMEngine.num_steps moved)."""
        return bool(self.scheduled)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Of num_cached_tokens, what the KV tiers copied back (engine/kv_cache/tiers.py): from
    # host memory, and from disk (a conversation resumed after a restart).
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
